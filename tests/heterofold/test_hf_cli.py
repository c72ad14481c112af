"""The `heterofold` command line parses its subcommands and documents them in --help."""
import pytest

from heterofold.cli import main


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(cmd in out for cmd in ("fit", "eval", "apply"))


@pytest.mark.parametrize("cmd", ["fit", "eval", "apply"])
def test_subcommand_help(capsys, cmd):
    with pytest.raises(SystemExit):
        main([cmd, "--help"])
    assert "--sender" in capsys.readouterr().out


def test_serve_help(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--http-port" in capsys.readouterr().out


def test_same_family_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["fit", "--sender", "llama", "--receiver", "llama"])
    assert e.value.code == 2
    assert "--sender and --receiver are both llama" in capsys.readouterr().err


def test_apply_without_a_map_says_how_to_fit_one_before_loading_the_zoo(tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["--root", str(tmp_path), "apply", "--sender", "llama", "--receiver", "qwen3", "some text"])
    assert str(e.value.code) == (f"heterofold apply: error: no map at {tmp_path / 'maps' / 'llama-to-qwen3'}: "
                                 "run `heterofold fit --sender llama --receiver qwen3` first")
    assert not (tmp_path / "zoo").exists()  # failed before building (training) any model


def test_benchmark_directions_are_checked():
    from argparse import ArgumentTypeError

    from heterofold.pipeline import parse_direction

    assert parse_direction("mistral:qwen3") == ("mistral", "qwen3")
    for bad in ("llama", "llama:llama", "llama:gpt2", "llama:qwen3:mistral"):
        with pytest.raises(ArgumentTypeError, match="two different families"):
            parse_direction(bad)


def test_eval_forwards_its_options_to_the_benchmark(monkeypatch):
    import benchmarks.heterofold_eval as bench

    seen = []
    monkeypatch.setattr(bench, "main", seen.append)
    main(["eval", "--sender", "mistral", "--receiver", "qwen3", "--split", "selection", "--methods", "heterofold",
          "--n-docs", "8"])
    assert seen == [["--directions", "mistral:qwen3", "--split", "selection", "--root", "artifacts/heterofold",
                     "--methods", "heterofold", "--n-docs", "8"]]


def test_zoo_steps_apply_to_new_models_and_an_existing_zoo_is_named(tmp_path, monkeypatch, capsys):
    import argparse
    import json

    from heterofold import cli

    log = tmp_path / "zoo" / "llama" / "train_log.json"
    log.parent.mkdir(parents=True)
    log.write_text(json.dumps({"config": {"steps": 1500}, "losses": []}))
    built = []
    monkeypatch.setattr(cli, "load_or_train", lambda family, root, cfg: built.append((family, cfg.steps)) or family)

    args = argparse.Namespace(root=str(tmp_path), sender="llama", receiver="qwen3", zoo_steps=700)
    assert cli._pair(args) == ("llama", "qwen3")
    assert built == [("llama", 700), ("qwen3", 700)]   # qwen3 is not trained yet: it gets the steps asked for
    err = capsys.readouterr().err
    assert "zoo model 'llama'" in err and "trained 1500 steps" in err and "qwen3" not in err

    built.clear()
    cli._pair(argparse.Namespace(root=str(tmp_path), sender="llama", receiver="qwen3", zoo_steps=None))
    assert built == [("llama", 500), ("qwen3", 500)] and capsys.readouterr().err == ""


def test_zoo_steps_must_be_positive(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--zoo-steps", "0", "fit", "--sender", "llama", "--receiver", "qwen3"])
    assert e.value.code == 2 and "not a positive number of steps" in capsys.readouterr().err


def test_apply_on_an_empty_text_and_an_unknown_family_say_so(served_root):
    from heterofold import zoo

    with pytest.raises(SystemExit) as e:
        main(["--root", str(served_root), "apply", "--sender", "llama", "--receiver", "qwen3", "  "])
    assert str(e.value.code) == "heterofold apply: error: the text is empty: the sender has nothing to prefill"
    from heterofold.registry import family_names

    known = ", ".join(sorted(family_names()))
    with pytest.raises(ValueError, match=f"unknown model family 'gpt2': the registered families are {known}"):
        zoo.load("gpt2", served_root)


def test_family_choices_are_the_registered_families(capsys):
    from heterofold.registry import family_names

    with pytest.raises(SystemExit) as e:
        main(["fit", "--sender", "gpt2", "--receiver", "llama"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'gpt2'" in err and all(repr(name) in err for name in family_names())
