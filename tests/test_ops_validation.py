"""Bad indices and values given to the Triton wrappers raise a clear ValueError (CPU tensors are
validated by default) instead of reading or writing out of bounds in the interpreter."""
import pytest
import torch

from kvrepro.formats import get_format
from kvrepro.formats.hadamard import rotation_matrix
from kvrepro.ops import decode_attention, prefill_attention, store_kv

L = get_format("k4v4").layout(128, 16)
R = rotation_matrix(128)


def _pool():
    return torch.zeros(4, 2, L.page_bytes, dtype=torch.uint8)


@pytest.mark.parametrize("seq_lens,table,scale,match", [
    ([100], [[0]], 0.1, "seq_lens needs 7 blocks but block_tables has 1 columns"),
    ([10], [[9]], 0.1, r"block ids outside \[0, 4\)"),
    ([-1], [[0]], 0.1, "seq_lens must be >= 0"),
    ([10], [[0]], float("nan"), "scale must be a finite positive float"),
])
def test_decode_refuses_bad_indices(seq_lens, table, scale, match):
    q = torch.randn(1, 8, 128).to(torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        decode_attention(q, _pool(), torch.tensor(table, dtype=torch.int32),
                         torch.tensor(seq_lens, dtype=torch.int32), L, R, scale)


def test_prefill_refuses_query_longer_than_sequence():
    q = torch.randn(5, 8, 128).to(torch.bfloat16)
    k = torch.randn(5, 2, 128).to(torch.bfloat16)
    with pytest.raises(ValueError, match="query length <= its seq_len"):
        prefill_attention(q, k, k, _pool(), torch.tensor([[0]], dtype=torch.int32),
                          torch.tensor([3], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32),
                          L, R, 0.1)


def test_store_refuses_out_of_range_slot_and_nan():
    pool = _pool()
    k = torch.randn(3, 2, 128).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"slot_mapping values must be -1 or in \[0, 64\)"):
        store_kv(k, k, pool, torch.tensor([0, 1, 64]), L, R)
    k[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        store_kv(k, k, pool, torch.tensor([0, 1, 2]), L, R)
    assert int(pool.count_nonzero()) == 0  # nothing was written by the refused calls


def test_validate_takes_none_true_or_false_only():
    """``validate`` is a bool switch: a string or an int (``"no"`` would read as true) is refused by name."""
    from kvrepro.ops.common import want_checks
    assert want_checks(None, torch.device("cpu")) and not want_checks(None, torch.device("cuda"))
    assert want_checks(True, torch.device("cuda")) and not want_checks(False, torch.device("cpu"))
    for bad in ("yes", "no", 1, 0):
        with pytest.raises(ValueError, match="validate must be None, True or False"):
            want_checks(bad, torch.device("cpu"))
