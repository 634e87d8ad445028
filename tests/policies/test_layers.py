"""The transformer blocks compute the same values with and without autograd (without it they write into
their own intermediate tensors), and grouped-query attention folded into one head per key/value head
equals the per-head computation."""

import pytest
import torch
import torch.nn.functional as F

from vla_rl.policies.layers import AdaRMSNorm, GatedMLP, RMSNorm, StreamLayer, ViTBlock, attention, rotary_tables


def perturbed(module: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return module


def same_with_and_without_autograd(fn, *inputs):
    with torch.inference_mode():
        inference = fn(*inputs)
    with torch.no_grad():
        no_grad = fn(*inputs)
    leaves = [x.clone().requires_grad_() for x in inputs]
    graph = fn(*leaves)
    graph.sum().backward()   # the autograd path stays differentiable
    assert all(x.grad is not None for x in leaves)
    assert torch.equal(inference, graph.detach())
    assert torch.equal(no_grad, graph.detach())


def test_gated_mlp_and_vit_block_without_autograd_equal_autograd():
    x = torch.randn(2, 7, 32)
    same_with_and_without_autograd(perturbed(GatedMLP(32, 64)), x)
    same_with_and_without_autograd(perturbed(ViTBlock(32, 4, 64)), x)


@pytest.mark.parametrize("adaptive", [False, True])
def test_stream_layer_without_autograd_equals_autograd(adaptive):
    layer = perturbed(StreamLayer(32, 64, num_heads=4, num_kv_heads=1, head_dim=8, rope_base=10000.0,
                                  cond_dim=16 if adaptive else None))
    rope = rotary_tables(torch.arange(7)[None].expand(2, 7), 8, 10000.0)
    mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    cond = torch.randn(2, 16) if adaptive else None

    def forward(h):
        q, k, v, gate = layer.project(h, rope, cond)
        return layer.finish(h, attention(q, k, v, mask), gate, cond)

    same_with_and_without_autograd(forward, torch.randn(2, 7, 32))


def test_rms_norms_match_their_formula():
    x = torch.randn(3, 5, 16)
    norm = perturbed(RMSNorm(16))
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    torch.testing.assert_close(norm(x), y * (1.0 + norm.weight), rtol=1e-6, atol=1e-6)
    ada, cond = perturbed(AdaRMSNorm(16, 8)), torch.randn(3, 8)
    scale, shift, gate = ada.modulation(cond)[:, None, :].chunk(3, dim=-1)
    out, out_gate = ada(x, cond)
    torch.testing.assert_close(out, y * (1.0 + scale) + shift, rtol=1e-6, atol=1e-6)
    assert torch.equal(out_gate, gate)


@pytest.mark.parametrize("query_rows", [1, 5])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_grouped_query_attention_equals_per_head_attention(kv_heads, query_rows):
    g = torch.Generator().manual_seed(kv_heads)
    n, hq, lq, lk, d = 2, 4, 5, 9, 8
    q = torch.randn(n, hq, lq, d, generator=g)
    k, v = torch.randn(n, kv_heads, lk, d, generator=g), torch.randn(n, kv_heads, lk, d, generator=g)
    mask = torch.rand(n, 1, query_rows, lk, generator=g) > 0.3
    mask[..., 0] = True
    rep = hq // kv_heads
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                              attn_mask=mask)
    torch.testing.assert_close(attention(q, k, v, mask), expected, rtol=1e-6, atol=1e-6)
