"""The vocabulary argmax the decoding loop chooses with gives PyTorch's own index in every case that can differ:
ties, NaN, rows of -inf, strided views, every dtype."""

import pytest
import torch

from specdec_kit.runtime.core.argmax import argmax_last


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.bfloat16])
def test_argmax_last_picks_the_index_torch_picks(dtype):
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(3, 5, 4099, generator=gen).to(dtype)
    values[0, 1, 7] = values[0, 1, 4000] = 1e4  # a tie: the first index
    values[1, 2, 11] = float("nan")  # NaN counts as the maximum
    values[1, 3, 9] = values[1, 3, 10] = float("nan")  # the first NaN
    values[2, 0] = float("-inf")  # nothing above -inf: index 0
    values[2, 4, -1] = float("inf")
    for view in (values, values[:, ::2], values.transpose(0, 1), values[0, 1], values[..., 1:]):
        chosen = argmax_last(view)
        assert chosen.dtype == torch.int64
        assert torch.equal(chosen, view.argmax(dim=-1))
    assert argmax_last(values)[0, 1] == 7 and argmax_last(values)[1, 3] == 9


def test_argmax_last_result_can_be_written():
    chosen = argmax_last(torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]]))
    chosen[0] = 5  # the decoding loop overwrites sampled rows' choices in place
    assert chosen.tolist() == [5, 0]
