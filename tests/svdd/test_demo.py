from sv_attention.svdd.demo import run_demo


def test_demo_runs_and_every_guarantee_holds(capsys):
    assert run_demo(seed=1) == 0
    out = capsys.readouterr().out
    assert "certified=True" in out and "bit-identical after the rejection: True" in out
    assert "every guarantee held" in out
