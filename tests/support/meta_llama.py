"""Meta's Llama forward pass, written out from the llama repository's model.py (which does not
install here), with mistral-inference's mixture of experts: what a Meta or Mistral checkpoint's
weights compute, to compare a converted model's logits with. Its rotary embedding pairs neighbouring features as complex numbers, the layout a
conversion to Hugging Face must permute (a missing permute changes the logits)."""

from __future__ import annotations

import math

import torch


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Meta's apply_rotary_emb: features (2j, 2j+1) rotated as one complex number."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs).flatten(-2)


def _ffn(w: dict[str, torch.Tensor], p: str, x: torch.Tensor) -> torch.Tensor:
    gate = torch.nn.functional.silu(x @ w[p + "w1.weight"].T)
    return (gate * (x @ w[p + "w3.weight"].T)) @ w[p + "w2.weight"].T


def _experts(w: dict[str, torch.Tensor], p: str, x: torch.Tensor, moe: dict) -> torch.Tensor:
    """mistral-inference's MoeLayer: the router's top k experts per token, weighted by a
    softmax over their k logits."""
    logits = x @ w[p + "gate.weight"].T
    top, chosen = torch.topk(logits, moe["num_experts_per_tok"], dim=-1)
    weights = top.float().softmax(-1)
    out = torch.zeros_like(x)
    for e in range(moe["num_experts"]):
        picked = ((chosen == e).to(x.dtype) * weights).sum(-1, keepdim=True)
        out = out + picked * _ffn(w, f"{p}experts.{e}.", x)
    return out


def meta_logits(
    weights: dict[str, torch.Tensor], params: dict, tokens: torch.Tensor
) -> torch.Tensor:
    """Logits of Meta's Transformer (fp32) for ``tokens`` [batch, seq], causal; with
    ``params["moe"]``, mistral-inference's mixture of experts in each layer."""
    w = {k: v.float() for k, v in weights.items()}
    dim, heads = params["dim"], params["n_heads"]
    kv_heads = params.get("n_kv_heads") or heads
    head_dim, eps = params.get("head_dim") or dim // heads, params["norm_eps"]
    theta = params.get("rope_theta", 10000.0)
    batch, seq = tokens.shape
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(seq).float(), inv)
    freqs = torch.polar(torch.ones_like(angles), angles).view(1, seq, 1, head_dim // 2)
    mask = torch.full((seq, seq), float("-inf")).triu(1)
    h = w["tok_embeddings.weight"][tokens]
    for i in range(params["n_layers"]):
        p = f"layers.{i}."
        x = _rms_norm(h, w[p + "attention_norm.weight"], eps)
        q = (x @ w[p + "attention.wq.weight"].T).view(batch, seq, heads, head_dim)
        k = (x @ w[p + "attention.wk.weight"].T).view(batch, seq, kv_heads, head_dim)
        v = (x @ w[p + "attention.wv.weight"].T).view(batch, seq, kv_heads, head_dim)
        q, k = _rotary(q, freqs), _rotary(k, freqs)
        repeat = heads // kv_heads
        k = k.repeat_interleave(repeat, dim=2)
        v = v.repeat_interleave(repeat, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim) + mask
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, heads * head_dim)
        h = h + out @ w[p + "attention.wo.weight"].T
        x = _rms_norm(h, w[p + "ffn_norm.weight"], eps)
        if "moe" in params:
            h = h + _experts(w, p + "feed_forward.", x, params["moe"])
        else:
            h = h + _ffn(w, p + "feed_forward.", x)
    return _rms_norm(h, w["norm.weight"], eps) @ w["output.weight"].T
