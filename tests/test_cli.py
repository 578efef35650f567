import subprocess
import sys

from sv_attention.cli import build_parser, main


def test_help_lists_subcommands(capsys):
    parser = build_parser()
    text = parser.format_help()
    assert "quickstart" in text
    assert main([]) == 0
    assert "usage" in capsys.readouterr().out


def test_console_script_help_runs():
    out = subprocess.run([sys.executable, "-m", "sv_attention.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "sv-attention" in out.stdout


def test_every_subcommand_help_renders(capsys):
    """Each group and subcommand formats its help (a stray '%' in a HELP string used to crash argparse)."""
    import pytest

    from sv_attention.cli import _command_modules

    commands = {m.COMMAND for m in _command_modules()}
    assert {"bench deletion", "reproduce forgetting", "export", "verify", "train"} <= commands
    prefixes = {c.split()[0] for c in commands} | commands
    for words in sorted(prefixes):
        with pytest.raises(SystemExit) as exc:
            main([*words.split(), "--help"])
        assert exc.value.code == 0, words
    assert "95%" in capsys.readouterr().out
