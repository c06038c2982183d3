"""The CPU kernels of cpu_kernels.py compute the same functions as the modules' own forwards."""

import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, WanRMS_norm

from lingbot_core.model.cpu_kernels import route_conv3d_to_onednn, use_fast_cpu_kernels


def test_batch_one_conv3d_routed_to_onednn_equals_conv3d():
    torch.manual_seed(0)
    conv = WanCausalConv3d(8, 8, 3, padding=1)
    x = torch.randn(1, 8, 3, 12, 20)  # batch 1, few channels: PyTorch's heuristic picks slow_conv3d here
    expected = conv(x)
    assert route_conv3d_to_onednn(conv) == 1
    with torch.profiler.profile() as prof:
        got = conv(x)
    names = {e.key for e in prof.key_averages()}
    assert "aten::mkldnn_convolution" in names and "aten::slow_conv3d_forward" not in names
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_routed_conv3d_has_the_same_gradients():
    torch.manual_seed(0)
    conv = WanCausalConv3d(4, 6, 3, padding=1)
    x = torch.randn(1, 4, 3, 8, 8, requires_grad=True)
    conv(x).square().sum().backward()
    expected = (x.grad.clone(), conv.weight.grad.clone())
    x.grad, conv.weight.grad = None, None
    route_conv3d_to_onednn(conv)
    conv(x).square().sum().backward()
    torch.testing.assert_close(x.grad, expected[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conv.weight.grad, expected[1], rtol=1e-4, atol=1e-4)


def test_channel_rms_norm_equals_wan_rms_norm_in_fp32_and_bf16():
    torch.manual_seed(0)
    norm = WanRMS_norm(8, images=False)
    with torch.no_grad():
        norm.gamma.uniform_(0.5, 1.5)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 8, 3, 5, 7).to(dtype)
        x[0, :, 0, 0, 0] = 0  # an all-zero channel vector: both clamp the norm at eps
        expected = norm.to(dtype)(x)
        fast = WanRMS_norm(8, images=False).to(dtype)
        fast.load_state_dict(norm.state_dict())
        assert use_fast_cpu_kernels(fast) == 1
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(fast(x), expected, rtol=tol, atol=tol)


def test_causal_conv_pads_inside_onednn_and_equals_diffusers_forward():
    """The routed causal convolution equals diffusers' forward for every way the streaming VAE calls it
    (no history: the past frames are zeros; one cached frame; two), copies no padded input when the
    cache supplies the past, and leaves a channels-last result for the next layer."""
    torch.manual_seed(0)
    conv = WanCausalConv3d(8, 12, 3, padding=1)
    reference = WanCausalConv3d(8, 12, 3, padding=1)
    reference.load_state_dict(conv.state_dict())
    assert route_conv3d_to_onednn(conv) == 1
    x = torch.randn(1, 8, 4, 10, 14)
    for cache in (None, torch.randn(1, 8, 1, 10, 14), torch.randn(1, 8, 2, 10, 14)):
        expected = reference(x, cache)
        with torch.profiler.profile() as prof:
            got = conv(x, cache)
        names = {e.key for e in prof.key_averages()}
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert got.is_contiguous(memory_format=torch.channels_last_3d)
        if cache is not None and cache.shape[2] == 2:
            assert "aten::constant_pad_nd" not in names  # the spatial padding happens inside the kernel
