"""One answer to "which demo": an explicit folder, else ROOT/demo, else models/demo, else the untrained demo, the same
for `mol2 chat`, `mol2 router`, `mol2 serve` and the Triton models."""

from __future__ import annotations

import argparse

import pytest

from ced import demo as demos


def fake_demo(folder, trained=True):
    """A demo folder as the resolver sees it (it opens no weights)."""
    (folder / "model").mkdir(parents=True)
    for name in ("config.json", "model.safetensors") + (("tokenizer.json",) if trained else ()):
        (folder / "model" / name).write_text("{}")
    (folder / "adapters" / "coding").mkdir(parents=True)
    return folder


@pytest.fixture()
def places(tmp_path, monkeypatch):
    """The project's artifacts/ and models/demo, moved under tmp_path; the untrained build only recorded."""
    monkeypatch.setattr(demos, "WORK_ROOT", tmp_path / "artifacts")
    monkeypatch.setattr(demos, "COMMITTED", tmp_path / "models" / "demo")
    built = []
    monkeypatch.setattr(demos, "untrained_demo", lambda root: built.append(root))
    return tmp_path, built


def test_the_order_given_then_built_then_committed_then_untrained(places):
    tmp, built = places
    assert demos.find_demo() == demos.Demo(tmp / "artifacts" / "demo-untrained", "untrained")
    assert built == [] and not (tmp / "artifacts").exists()  # finding builds nothing: the server only finds
    fake_demo(tmp / "models" / "demo")
    assert demos.find_demo() == demos.Demo(tmp / "models" / "demo", "committed")
    fake_demo(tmp / "artifacts" / "demo")
    assert demos.find_demo() == demos.Demo(tmp / "artifacts" / "demo", "built")  # the fresh build the router trains on
    given = fake_demo(tmp / "mine")
    assert demos.find_demo(given) == demos.find_demo(given / "model") == demos.Demo(given, "given")
    other_root = fake_demo(tmp / "other" / "demo").parent
    assert demos.find_demo(root=other_root).root == other_root / "demo"


def test_the_untrained_demo_is_built_only_when_chosen(places):
    tmp, built = places
    assert not demos.resolve_demo().trained
    assert built == [tmp / "artifacts" / "demo-untrained"]
    fake_demo(tmp / "models" / "demo")
    found = demos.resolve_demo()
    assert found.trained and found.tokenizer == found.model_dir / "tokenizer.json" and len(built) == 1
    assert demos.resolve_demo(tmp / "new").root == tmp / "new" and built[-1] == tmp / "new"


def test_a_given_folder_that_holds_something_else_is_refused(places):
    tmp, built = places
    (tmp / "notes").mkdir()
    (tmp / "notes" / "todo.txt").write_text("not a demo")
    with pytest.raises(FileNotFoundError, match="holds no demo"):
        demos.resolve_demo(tmp / "notes")
    assert built == []


def test_an_untrained_model_of_ones_own_is_used_not_rebuilt(places):
    tmp, built = places
    given = fake_demo(tmp / "mine", trained=False)
    found = demos.resolve_demo(given)
    assert (found.trained, found.tokenizer, found.tag, built) == (False, "bytes", "demo-untrained", [])


def test_every_command_and_the_server_find_the_same_demo(places, capsys):
    from mol2_router.cli import _demo
    from python_backend.core.settings import demo_model_dir

    tmp, _ = places
    fake_demo(tmp / "models" / "demo")
    fake_demo(tmp / "artifacts" / "demo")
    router = _demo(argparse.Namespace(demo=None, artifacts=None))
    assert router.model_dir == demo_model_dir() == tmp / "artifacts" / "demo" / "model"
    said = capsys.readouterr().out
    assert said == f"demo: {tmp / 'artifacts' / 'demo'} (trained; the fresh build, before models/demo)\n"
