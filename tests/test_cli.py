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
