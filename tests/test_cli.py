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


def _one_line_error(capsys, argv, code=2):

    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse validation
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == code, err
    lines = [ln for ln in err.strip().splitlines() if "error:" in ln]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_bad_arguments_and_files_are_one_line_errors(tmp_path, capsys):
    """Issue 15: no traceback for bad values or missing / invalid files; a one-line error and status 2."""
    for argv in (["bench", "deletion", "--sizes", "-5"], ["bench", "deletion", "--sizes", "0"],
                 ["bench", "deletion", "--trials", "0"], ["bench", "deletion", "--sizes", "x"],
                 ["reproduce", "robustness", "--ops", "0"]):
        line = _one_line_error(capsys, argv)
        assert "expected an integer" in line or "invalid" in line, line
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    missing = str(tmp_path / "missing.json")
    line = _one_line_error(capsys, ["export", str(ckpt), "--out", str(tmp_path / "o"), "--training-run", missing])
    assert line == f"sv-attention export: error: cannot open {missing}: No such file or directory"
    assert _one_line_error(capsys, ["train", "--config", missing]).endswith(f"cannot open {missing}: No such file or "
                                                                            "directory")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "is not valid JSON" in _one_line_error(capsys, ["export", str(ckpt), "--out", str(tmp_path / "o"),
                                                          "--training-run", str(bad)])
    (ckpt / "config.json").write_text("{not json")
    assert "config" in _one_line_error(capsys, ["export", str(ckpt), "--out", str(tmp_path / "o2")])

