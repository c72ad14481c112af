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
