import threading

import pytest
import torch

from sv_attention.errors import InvalidHyperparameterError
from sv_attention.threads import torch_threads


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_nested_scopes_restore_the_enclosing_setting(two_threads):
    with torch_threads(1):
        assert torch.get_num_threads() == 1
        with torch_threads(2):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), torch_threads(1):
        raise RuntimeError("inside")
    assert torch.get_num_threads() == 2
    with pytest.raises(InvalidHyperparameterError):
        with torch_threads(0):
            pass
    with torch_threads(None):
        assert torch.get_num_threads() == 2


def test_overlapping_scopes_of_two_threads_restore_the_original_setting(two_threads):
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def a():
        with torch_threads(1):
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def b():
        a_in.wait(5)
        with torch_threads(1):
            b_in.set()
            a_out.wait(5)  # A exits first: its restore must not undo B's scope, nor B's A's

    ta, tb = threading.Thread(target=a), threading.Thread(target=b)
    ta.start(), tb.start()
    ta.join(10), tb.join(10)
    assert torch.get_num_threads() == 2


def test_outer_threads_reads_the_setting_from_outside_every_scope(two_threads):
    from sv_attention.threads import outer_threads

    before = torch.get_num_threads()
    assert before == 2 and outer_threads() == before
    with torch_threads(1):
        assert torch.get_num_threads() == 1 and outer_threads() == before
        with torch_threads(1):
            assert outer_threads() == before
    assert outer_threads() == torch.get_num_threads() == before
