"""Two CPU kernels for the Wan VAE that PyTorch's defaults make slow at streaming sizes.

1. 3D convolutions go to oneDNN whatever the batch size.

PyTorch picks a CPU kernel for `conv3d` by a heuristic (ConvUtils `use_mkldnn`): for a batch of one
with 3x3 kernels it uses oneDNN only when batch x channels x frames x height exceeds 20480, and
otherwise its im2col kernel `slow_conv3d`. A streaming decoder runs exactly that case at every layer
(one latent frame plus two cached ones, a few dozen channels), where `slow_conv3d` is 4-5x slower than
oneDNN on the same input (`python benchmarks/bench_vae_sizes.py --variants` prints both) and was most
of the embedded model's block time.

`route_conv3d_to_onednn(vae)` makes each `Conv3d` of the module call `torch.mkldnn_convolution`
directly for CPU float32 inputs (bfloat16 too where oneDNN runs it), the kernel the heuristic picks for larger inputs; the
result is the same convolution (equal to `conv3d` within float rounding). Weights, state dict and
checkpoint layout are untouched; CUDA tensors and other dtypes keep the module's own forward. It
supports autograd, so training uses it too. The VAE's causal convolutions (`WanCausalConv3d`) also
leave their spatial zero padding to oneDNN instead of copying each input into a padded tensor, and
hand it channels-last operands, the layout its kernels for few channels use (`_causal_conv_forward`).

2. The channel RMS norm (diffusers' `WanRMS_norm`, `F.normalize` over dim 1 of an NCTHW tensor) runs
`linalg_vector_norm` as a strided reduction across channels, which took 44% of a streaming decode;
`x * rsqrt(max(sum(x^2), eps^2))` over the same dim is the same function (equal within float rounding)
and about 4x faster, because summing whole channel planes vectorises.

`use_fast_cpu_kernels(vae)` applies both to one module's instances (nothing global is patched), and
the streamed and one-shot paths of that module share them, so streamed == one-shot stays exact.
"""

from __future__ import annotations

import types

import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, WanRMS_norm
from torch import nn
from torch.nn import functional as F

# Read once: dynamo cannot trace these queries inside a compiled forward. oneDNN's bf16 convolution
# needs AVX512-BF16/AMX-class support (an AVX2-only CPU raises), so bf16 is routed only where it runs.
_ONEDNN = torch.backends.mkldnn.is_available()
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16) if _ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported() \
    else (torch.float32,)


# oneDNN's kernels for few channels work on channels-last data: a plain-layout operand is reordered on
# the way in and the result on the way out, in every call. Every convolution here therefore hands it
# channels-last operands; in eager mode its channels-last output flows on (norms, activations and the
# streaming caches keep that layout), so the next convolution reorders nothing.
_CHANNELS_LAST = torch.channels_last_3d


@torch.library.custom_op("lingbot::onednn_conv", mutates_args=())
def _onednn_conv(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, padding: list[int],
                 stride: list[int], dilation: list[int], groups: int) -> torch.Tensor:
    """`torch.mkldnn_convolution` as an op a compiled graph can hold, computed as eager computes it, on
    channels-last operands to a channels-last result, so a compiled step replays eager exactly (the
    norms between convolutions sum over channels in the same order). oneDNN's output layout follows its
    operand's, and inductor may lay an intermediate out either way, so a graph that called the aten op
    directly could meet a layout its trace did not predict; a custom op keeps the strides it declares.
    (oneDNN answers a channels-last operand whose frames or batch are 1 with a plain result: the layout
    is ambiguous there, hence the final conversion, a no-op otherwise.)"""
    return _onednn_eager(input, weight, bias, padding, stride, dilation, groups).contiguous(
        memory_format=_CHANNELS_LAST)


@_onednn_conv.register_fake
def _(input, weight, bias, padding, stride, dilation, groups):
    out = torch.ops.aten.convolution.default(input, weight, bias, stride, padding, dilation, False,
                                             [0] * len(padding), groups)
    return out.contiguous(memory_format=_CHANNELS_LAST)


def _onednn_eager(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, padding: list[int],
                  stride: list[int], dilation: list[int], groups: int) -> torch.Tensor:
    # The aten op has autograd (training uses it) and no custom-op dispatch cost.
    return torch.mkldnn_convolution(input.contiguous(memory_format=_CHANNELS_LAST),
                                    weight.contiguous(memory_format=_CHANNELS_LAST), bias, padding, stride,
                                    dilation, groups)


def _onednn(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, padding: list[int],
            stride: list[int], dilation: list[int], groups: int) -> torch.Tensor:
    if torch.compiler.is_compiling():  # inference graphs only: the custom op has no autograd formula
        return _onednn_conv(input, weight, bias, padding, stride, dilation, groups)
    return _onednn_eager(input, weight, bias, padding, stride, dilation, groups)


def _runs_on_onednn(x: torch.Tensor) -> bool:
    return _ONEDNN and x.device.type == "cpu" and x.dtype in _ONEDNN_DTYPES and x.dim() == 5  # batched NCTHW


def _onednn_conv_forward(self: nn.Conv3d, input: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    if not _runs_on_onednn(input) or self.padding_mode != "zeros" or isinstance(self.padding, str):
        return nn.Conv3d._conv_forward(self, input, weight, bias)
    return _onednn(input, weight, bias, list(self.padding), list(self.stride), list(self.dilation), self.groups)


def _causal_conv_forward(self: WanCausalConv3d, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    """`WanCausalConv3d.forward` with its spatial zero padding done inside the oneDNN convolution.

    diffusers pads every input with `F.pad` (a new tensor: a zero fill of the padded size and a copy of
    the input) and then convolves without padding. The padding is the same zeros either way; oneDNN
    applies it inside the kernel. Only the causal (past) frames are still padded explicitly, where
    there is no cached history. With the channels-last operands this made the embedded model's
    streaming decode about a quarter faster (`python benchmarks/bench_block.py` shows the decode stage).
    """
    symmetric = self._padding[0] == self._padding[1] and self._padding[2] == self._padding[3]
    if not _runs_on_onednn(x) or not symmetric or self.padding_mode != "zeros":
        return WanCausalConv3d.forward(self, x, cache_x)
    past = self._padding[4]
    if cache_x is not None and past > 0:
        x = torch.cat([cache_x.to(x.device), x], dim=2)
        past -= cache_x.shape[2]
    if past != 0:  # zeros for missing history; a longer cache than the kernel reads is cut, as diffusers does
        x = F.pad(x, (0, 0, 0, 0, past, 0))
    padding = [0, self._padding[2], self._padding[0]]  # time, height, width
    return _onednn(x, self.weight, self.bias, padding, list(self.stride), list(self.dilation), self.groups)


def route_conv3d_to_onednn(module: nn.Module) -> int:
    """Point every Conv3d in `module` at oneDNN on the CPU; returns how many were routed."""
    routed = 0
    for sub in module.modules():
        if isinstance(sub, WanCausalConv3d):  # pads inside the kernel, then convolves as below
            sub.forward = types.MethodType(_causal_conv_forward, sub)
        if isinstance(sub, nn.Conv3d):
            sub._conv_forward = types.MethodType(_onednn_conv_forward, sub)
            routed += 1
    return routed


_NORMALIZE_EPS = 1e-12  # F.normalize's default, which WanRMS_norm uses


def _channel_rms_norm_forward(self: WanRMS_norm, x: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cpu" or not self.channel_first:
        return WanRMS_norm.forward(self, x)
    compute = x.float() if x.dtype != torch.float32 else x  # WanRMS_norm normalises low precision in fp32
    inverse = (compute * compute).sum(dim=1, keepdim=True).clamp_min(_NORMALIZE_EPS ** 2).rsqrt()
    return (compute * inverse).to(x.dtype) * self.scale * self.gamma + self.bias


def use_fast_cpu_kernels(module: nn.Module) -> int:
    """Both kernels above on every Conv3d and channel-first WanRMS_norm of `module`; returns how many."""
    count = route_conv3d_to_onednn(module)
    for sub in module.modules():
        if isinstance(sub, WanRMS_norm):
            sub.forward = types.MethodType(_channel_rms_norm_forward, sub)
            count += 1
    return count
