"""The PLE n-gram token columns (Triton, `ple_ngram_triton`) vs `ple_ref.ngram_tokens_batched` and vs
the rule spelled out over each sequence's whole history; windows advanced or left alone; a verify
block then the replay of its accepted rows equals decoding them one a step."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from tests.kernels.conftest import DEVICES  # noqa: E402

from freetoken.kernels import ple_ngram_triton, ple_ref  # noqa: E402
from freetoken.kernels.batched import SeqBatch  # noqa: E402

EOS, NGRAM = 7, 3
HISTORY = NGRAM - 1


def rule(history: list[int], t: int) -> list[int]:
    """tok_s of position t of a sequence whose ids are history: history[t - s] unless position t - s is
    before 0 or an EOS lies at t - s + 1 .. t - 1."""
    return [history[t - s] if t - s >= 0 and EOS not in history[t - s + 1 : t] else EOS for s in range(NGRAM)]


def make_batch(num_rows, num_cached, slots, device):
    starts = [sum(num_rows[:i]) for i in range(len(num_rows))]
    return SeqBatch(tuple(starts), tuple(num_rows), tuple(num_cached), tuple(slots), (), torch.device(device))


def setup(device, histories, num_rows, slots, num_slots):
    """Windows holding each sequence's ids before its rows (garbage before position 0), the step's ids."""
    windows = torch.full((num_slots, HISTORY), 12345, dtype=torch.int64)
    ids = []
    for hist, n, slot in zip(histories, num_rows, slots):
        cached = len(hist) - n
        for j in range(HISTORY):
            if cached - HISTORY + j >= 0:
                windows[slot, j] = hist[cached - HISTORY + j]
        ids += hist[cached:]
    return windows.to(device), torch.tensor(ids, dtype=torch.int64, device=device)


# a sequence from its start (EOS inside), one with one window entry before position 0, one with an EOS in its
# window, one without rows, one far along with two EOS in a row
HISTORIES = [[3, 4, EOS, 5, 6], [9, 8, 2], [1, 2, 3, EOS, 4, 4, 5], [5, 6, 9], [3] * 10 + [EOS, EOS, 2, 3]]
NUM_ROWS, SLOTS = [5, 2, 3, 0, 4], [2, 0, 4, 1, 3]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("write_state", [True, False])
def test_ngram_tokens_match_reference_and_rule(device, write_state):
    windows, ids = setup(device, HISTORIES, NUM_ROWS, SLOTS, 5)
    batch = make_batch(NUM_ROWS, [len(h) - n for h, n in zip(HISTORIES, NUM_ROWS)], SLOTS, device)
    want_w, got_w = windows.clone(), windows.clone()
    want = ple_ref.ngram_tokens_batched(want_w, ids, batch, EOS, NGRAM, write_state)
    got = ple_ngram_triton.ngram_tokens(got_w, ids, batch, EOS, NGRAM, write_state)
    assert torch.equal(got, want)
    assert torch.equal(got_w, want_w)
    expected = [rule(h, t) for h, n in zip(HISTORIES, NUM_ROWS) for t in range(len(h) - n, len(h))]
    assert got.tolist() == expected
    if not write_state:
        assert torch.equal(got_w, windows)
    else:
        assert torch.equal(got_w[1], windows[1])  # the sequence without rows
        for hist, slot in zip(HISTORIES, SLOTS):
            tail = [hist[p] if p >= 0 else EOS for p in range(len(hist) - HISTORY, len(hist))]
            assert got_w[slot].tolist() == tail


@pytest.mark.parametrize("device", DEVICES)
def test_rows_are_invariant_to_batch(device):
    windows, ids = setup(device, HISTORIES, NUM_ROWS, SLOTS, 5)
    cached = [len(h) - n for h, n in zip(HISTORIES, NUM_ROWS)]
    full = ple_ngram_triton.ngram_tokens(windows.clone(), ids, make_batch(NUM_ROWS, cached, SLOTS, device), EOS, NGRAM)
    start = 0
    for n, c, slot in zip(NUM_ROWS, cached, SLOTS):
        alone = ple_ngram_triton.ngram_tokens(windows.clone(), ids[start : start + n], make_batch([n], [c], [slot], device), EOS, NGRAM)
        assert torch.equal(alone, full[start : start + n])
        start += n


@pytest.mark.parametrize("device", DEVICES)
def test_verify_then_replay_equals_decode(device):
    histories, k = [[4, 5, 6, 2, EOS, 3], [8, 9, 1, 1]], 4
    windows, ids = setup(device, histories, [k, k], [1, 0], 2)
    cached = [len(h) - k for h in histories]
    batch = make_batch([k, k], cached, [1, 0], device)
    w_verify = windows.clone()
    verify = ple_ngram_triton.ngram_tokens(w_verify, ids, batch, EOS, NGRAM, write_state=False)
    assert torch.equal(w_verify, windows)
    accepted = [2, 4]
    w_replay = windows.clone()
    ple_ngram_triton.ngram_tokens(w_replay, ids, batch.accepted(accepted), EOS, NGRAM)  # the verify layout cut to the accepted rows
    w_decode = windows.clone()
    for step in range(k):
        idx = torch.tensor([step, k + step], device=device)
        out = ple_ngram_triton.ngram_tokens(w_decode, ids[idx], make_batch([1, 1], [c + step for c in cached], [1, 0], device), EOS, NGRAM)
        assert torch.equal(out, verify[idx]), step
        if step + 1 == accepted[0]:
            assert torch.equal(w_decode[1], w_replay[1])
    assert torch.equal(w_decode[0], w_replay[0])
