"""Check the canonical [B, H, S, D] layout and record shapes.

The op takes any strides, so HF's ``view(B, S, H, D).transpose(1, 2)`` reaches
it with no copy; this pass only refuses what the op cannot read and writes the
shapes into the report.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from .site import AttentionSite, first_reason, shape_of

NEEDS_GRAD = "q/k/v require grad"
"""The start of the reason a site traced with autograd on stays dense (the backend warns on it)."""


def _fmt(shape):
    return "x".join(str(s) for s in shape)


def _requires_grad(*nodes) -> bool:
    """Whether Dynamo traced any of ``nodes`` as a tensor that requires grad (grad mode on, a parameter
    upstream): AOTAutograd then traces a backward through the site, and the sparse op has none."""
    return any(getattr(n.meta.get("example_value"), "requires_grad", False) for n in nodes)


def _shapes(site: AttentionSite) -> tuple:
    return shape_of(site.query), shape_of(site.key), shape_of(site.value)


def _not_4d(site: AttentionSite) -> Optional[str]:
    q, k, v = _shapes(site)
    if len(q) != 4 or len(k) != 4 or len(v) != 4:
        return f"q/k/v are not 4-D [B, H, S, D] ({len(q)}-D, {len(k)}-D, {len(v)}-D)"
    return None


def _shapes_disagree(site: AttentionSite) -> Optional[str]:
    q, k, v = _shapes(site)
    return "q/k/v shapes disagree" if k[:3] != v[:3] or q[0] != k[0] or q[3] != k[3] else None


def _heads_not_grouped(site: AttentionSite) -> Optional[str]:
    q, k, _ = _shapes(site)
    return f"{q[1]} query heads is not a multiple of {k[1]} kv heads" if q[1] % k[1] != 0 else None


def _value_dim_differs(site: AttentionSite) -> Optional[str]:
    q, _, v = _shapes(site)
    return f"value head dim {v[3]} differs from query head dim {q[3]}" if v[3] != q[3] else None


def _dropout(site: AttentionSite) -> Optional[str]:
    return f"dropout p={site.dropout_p} (sparse attention is inference-only)" if site.dropout_p != 0.0 else None


def _needs_grad(site: AttentionSite) -> Optional[str]:
    if _requires_grad(site.query, site.key, site.value):
        return (f"{NEEDS_GRAD} (sparse attention is inference-only: run the prefill under "
                "torch.inference_mode() or torch.no_grad())")
    return None


CHECKS = (_not_4d, _shapes_disagree, _heads_not_grouped, _value_dim_differs, _dropout, _needs_grad)
"""In order: each reads what the ones before it checked (the 4-D shapes)."""


def run(sites: list[AttentionSite]) -> list[AttentionSite]:
    out = []
    for site in sites:
        q, k, v = _shapes(site)
        if q is None or k is None or v is None:
            out.append(site.blocked("q/k/v have no tensor metadata"))
            continue
        site = dataclasses.replace(site, shapes=f"q {_fmt(q)} k {_fmt(k)} v {_fmt(v)}")
        out.append(site.blocked(first_reason(CHECKS, site)))
    return out
