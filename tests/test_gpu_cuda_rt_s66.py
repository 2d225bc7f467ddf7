"""GPU-only (skipped without CUDA): kernels/cuda_rt.current_stream is torch.cuda.current_stream without its Python,
so it must answer the stream current now, whichever that is. Session 66's GPU mutation check found no test telling
them apart: a cache that answered the first stream it had made (R3) passed every GPU test, since they all run on
the default stream. A transfer or a graph step enqueued from under `with torch.cuda.stream(s)` would order itself
against the wrong stream."""
import pytest
import torch

pytestmark = pytest.mark.gpu


def test_current_stream_answers_the_stream_made_current_and_then_the_one_before():
    from kernels import cuda_rt
    device = torch.device("cuda")
    default = cuda_rt.current_stream(device)
    assert default == torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        assert cuda_rt.current_stream(device) == side
        assert cuda_rt.current_stream(device).cuda_stream == side.cuda_stream
    assert cuda_rt.current_stream(device) == default
