"""Tensor parallelism: which of the model's query heads a rank's attention sites hold.

A semantic config is written for the whole model: one entry per (layer, global query head). Under tensor
parallelism each rank runs a slice of every layer's heads, so the backend must know the rank's first global
query head to read the right entries. This module reads it from the graph, so no option is needed.

How HF transformers shards a model (``from_pretrained(..., tp_plan="auto")`` under torchrun, or
``DistributedConfig(tp_size=...)``), on 5.17 to 5.25 alike: the TP plan marks the attention's q/k/v
projections "colwise", and their weights become DTensors placed ``Shard(0)`` over the TP mesh. Rank ``r`` of
``W`` holds output rows ``[r·N/W, (r+1)·N/W)`` of the query projection (``N = Hq·head_dim``), which are
the global query heads ``[r·Hq/W, (r+1)·Hq/W)``. With autograd off (a prefill) HF's hooks run each projection
on ``to_local()`` weights, so the graph Dynamo hands the backend holds plain local tensors: each site's
query has ``Hq/W`` heads, and the all-reduce after ``o_proj`` is a functional collective in the graph.

The graph's parameter inputs keep their values (the DTensors, with mesh and placements: the TP plan as it
was applied, whether it came from ``tp_plan="auto"``, a user's plan or ``parallelize_module``) and their
module paths. :func:`read` follows each site's query back through the nodes of its own attention module to
the parameters it reads, and accepts one sharded projection that the key does not read, with its weight
``Shard(0)`` on a 1-D mesh, whose rows divide into whole heads per rank, and whose local slice has exactly
the site's head count. Anything else under tensor parallelism keeps the site dense, with the reason: a wrong
offset would run other heads' patterns without a word. A graph with no DTensor input is not tensor-parallel
as far as this module can tell (a model sharded by hand gives ``options={"head_offset": ...}``).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.fx as fx

from .passes import layers
from .passes.site import AttentionSite

if torch.distributed.is_available():  # a torch built without distributed has no DTensor, so no sharded input
    from torch.distributed.tensor import DTensor, Shard
else:
    DTensor = Shard = None


_DTENSOR_QUERY = ("tensor parallel: the query is a DTensor (HF's DTensor path, taken with autograd on); the op takes "
                  "local tensors")


@dataclasses.dataclass(frozen=True)
class HeadShare:
    """One rank's share of the model's query heads, as read from the sharded query projection."""

    rank: int
    """this rank's coordinate in the tensor-parallel mesh (not its global rank when TP is one of several dims)"""
    world: int
    """ranks in the tensor-parallel mesh"""
    first_head: int
    """global index of this rank's first query head: the config's head of the site's local head 0"""
    num_heads: int
    """query heads each site of this rank holds"""
    total_heads: int
    """query heads of the whole model"""
    projection: str
    """the sharded weight the share was read from (``model.layers.0.self_attn.q_proj.weight``); "": the sites
    hold every head (the projections' outputs are gathered, as Phi-3's fused ``qkv_proj`` is)"""

    def describe(self) -> str:
        if not self.projection:
            return (f"tensor parallel: rank {self.rank} of {self.world}; its sites hold all {self.total_heads} query heads "
                    "(gathered projection outputs)")
        return (f"tensor parallel: rank {self.rank} of {self.world} holds query heads {self.first_head}.."
                f"{self.first_head + self.num_heads - 1} of {self.total_heads} (rows of {self.projection}, Shard(0))")


@dataclasses.dataclass(frozen=True)
class _Param:
    path: tuple
    """module path of the owning module"""
    name: str
    value: object


def _tensor_parallel_params(gm: fx.GraphModule) -> dict:
    """placeholder node -> _Param for every DTensor parameter input of ``gm``."""
    if DTensor is None:
        return {}
    found = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("example_value")
        if not isinstance(value, DTensor):
            continue
        path = layers.parameter_path(node)
        if path is not None:
            found[node] = _Param(path[:-1], path[-1], value)
    return found


def _read_within(start: fx.Node, inside: tuple, path_of) -> set:
    """Placeholders that ``start`` is computed from through nodes of the module at ``inside`` (or its
    submodules); the walk stops at nodes of other modules (the layer norm before the attention, the rotary
    embedding's cos/sin), so only this attention's own projections are reached, not earlier layers'.

    It walks through nodes of no known module: transformers 5.25 traces ``apply_rotary_pos_emb`` (a function that
    hub kernels may replace) with no module stack, between the query projection and the attention."""
    seen, todo, reached = set(), [start], set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            reached.add(node)
            continue
        path = path_of(node)
        if node is not start and path is not None and path[:len(inside)] != inside:
            continue
        todo.extend(node.all_input_nodes)
    return reached


def _rank_and_world(params: dict) -> tuple[int, int]:
    """This rank's place in the mesh the graph's sharded parameters live on (the TP mesh)."""
    mesh = next(iter(params.values())).value.device_mesh
    if mesh.ndim == 1:
        return mesh.get_local_rank(), mesh.size()
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def _share_of(site: AttentionSite, params: dict, path_of, model_heads: Optional[int]
              ) -> tuple[Optional[HeadShare], str]:
    """This site's share of the heads, or the reason it cannot be read."""
    query = site.query.meta.get("example_value")
    heads = query.shape[1]
    if model_heads is not None and heads == model_heads:
        # every head, in order: a gathered projection output ("colwise_gather_output", Phi-3's fused qkv_proj)
        return HeadShare(*_rank_and_world(params), 0, heads, heads, ""), ""
    attention = path_of(site.node)
    if attention is None:
        return None, "tensor parallel: the site's module path is not known, so which sharded projection its query reads is not"
    # only the attention's own parameters: a walk through nodes of no module may reach others' placeholders
    own = {n for n, p in params.items() if p.path[:len(attention)] == attention}
    from_query = {params[n].path: params[n] for n in _read_within(site.query, attention, path_of) if n in own}
    from_key = {params[n].path for n in _read_within(site.key, attention, path_of) if n in own}
    if not from_query:
        return None, ("tensor parallel: the query reads no sharded projection of its attention module, so which of the "
                      "model's heads it holds is not known (give options={'head_offset': ...})")
    if len(from_query) > 1:
        names = ", ".join(".".join(p) for p in sorted(from_query))
        return None, f"tensor parallel: the query reads several sharded projections ({names}); its heads are not read"
    owner = next(iter(from_query))
    if owner in from_key:
        return None, (f"tensor parallel: {'.'.join(owner)} projects both the query and the key (fused QKV); which "
                      "query heads its shard holds is not read")
    weight = next((p for p in params.values() if p.path == owner and p.name == "weight"), None)
    where = ".".join(owner + ("weight",))
    if weight is None:
        return None, f"tensor parallel: {'.'.join(owner)} has no sharded weight among the graph's inputs"
    value = weight.value
    if value.device_mesh.ndim != 1 or len(value.placements) != 1 or type(value.placements[0]) is not Shard \
            or value.placements[0].dim not in (0, -value.ndim):
        return None, (f"tensor parallel: {where} is placed {tuple(value.placements)} on a {value.device_mesh.ndim}-D "
                      "mesh; only rows sharded on a 1-D mesh (colwise) are read")
    world, rank = value.device_mesh.size(), value.device_mesh.get_local_rank()
    rows, head_dim = value.shape[0], query.shape[-1]
    if not isinstance(heads, int) or rows % head_dim or (rows // head_dim) % world:
        return None, (f"tensor parallel: {where} has {rows} rows, not whole heads of {head_dim} split evenly over "
                      f"{world} ranks")
    total = rows // head_dim
    if heads != total // world:
        return None, (f"tensor parallel: the query holds {heads} heads; {world} even shards of {where}'s {total} "
                      f"heads hold {total // world} each")
    return HeadShare(rank, world, rank * heads, heads, total, where), ""


def read(gm: fx.GraphModule, sites: list[AttentionSite], *, derive: bool = True,
         model_heads: Callable[[], Optional[int]] = lambda: None) -> tuple[list[AttentionSite], Optional[HeadShare]]:
    """The sites, kept dense where tensor parallelism makes them unreadable, and this rank's share of the heads
    (None: the graph has no sharded parameter input, or no site's share could be read). ``model_heads()``: the
    model's query heads where known (its HF config), called only for a sharded graph, so that a site holding all
    of them is known to start at head 0 whatever its projection's sharding.
    ``derive=False`` (the user gave ``head_offset``, which wins) still reads the share, for the report, but
    keeps dense only the sites whose query is a DTensor, which the op cannot take."""
    sites = [s.blocked(_DTENSOR_QUERY) if DTensor is not None and isinstance(s.query.meta.get("example_value"), DTensor)
             else s for s in sites]
    params = _tensor_parallel_params(gm)
    if not params:
        return sites, None
    tree, whole = layers.module_tree(gm), model_heads()
    paths: dict = {}

    def path_of(node: fx.Node) -> Optional[tuple]:
        if node not in paths:
            stack = node.meta.get("nn_module_stack")
            paths[node] = tree.path_of(layers.module_path(stack)) if tree is not None and stack else None
        return paths[node]

    share, out = None, []  # the first site's share is the graph's: one offset per graph
    for site in sites:
        if site.blocker:
            out.append(site)
            continue
        this, reason = _share_of(site, params, path_of, whole)
        if this is not None and share is None:
            share = this
        elif this is not None and (this.first_head, this.num_heads) != (share.first_head, share.num_heads):
            reason = (f"tensor parallel: this site holds query heads {this.first_head}..{this.first_head + this.num_heads - 1}, "
                      f"the graph's first site {share.first_head}..{share.first_head + share.num_heads - 1}")
        out.append(site.blocked(reason) if derive else site)
    return out, share
