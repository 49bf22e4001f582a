"""LoRA adapters on the TSP schedules (docs/lora.md; bytes in docs/design.md "LoRA").

A LoRA projection computes ``W x + s B A x`` (``s`` = lora_alpha / r, or / sqrt(r) with
rsLoRA). Under TSP the base ``W`` stays a sharded, frozen weight that the rounds and the ring
move as before; ``A`` [r, in] and ``B`` [out, r] are tiny and replicated on every rank, applied
to this rank's own tokens, so they move nothing in the forward and their gradients are summed
over the group once (``local_replicated``: one all-reduce per tensor, like a norm's). The
schedules take the adapter as low-rank tensors beside the base shards:

- a projection whose input is the layer input (q, k, v, gate, up: :data:`INPUT_SIDE`) gets
  ``u = s x A^T`` [B, L, r] (computed here, outside the schedule) and ``B``; the schedule adds
  ``u @ B[rows]^T`` to the rows of the output it computes in a round (the owner's rows) and
  returns the gradients of ``u`` and ``B``;
- a projection Hugging Face fuses (Phi-3's ``qkv_proj``, ``gate_up_proj``: :class:`TSPFusedLoRA`)
  is its parts' input-side adapters with one ``u`` and ``B`` split by rows;
- a projection whose input is computed inside the schedule (o after attention, down after the
  activation: :data:`OUTPUT_SIDE`) gets ``A``; the schedule returns ``z = in @ A^T`` [B, L, r],
  summed over the rounds' column slices, and ``s z B^T`` is added here.

:class:`TSPLoRA` is the adapter of one projection: it takes the projection's place in the TSP
module (the base weight under ``base_layer``, as PEFT names it) and holds ``lora_A`` /
``lora_B`` under PEFT's names, so a converted PeftModel keeps PEFT's parameter names."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..distributed import traced
from ..distributed.mesh import TSPMesh
from ..distributed.params import REPLICATED, ShardedModule, ShardSpec, local, local_replicated
from .dropout import RankDropoutModule

INPUT_SIDE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
OUTPUT_SIDE = ("o_proj", "down_proj")


@dataclass(frozen=True)
class LowRank:
    """The adapted projections of one schedule call, in the order their tensors follow the
    schedule's weights: two per input-side projection (u, B), one per output-side one (A), two
    for an output-side one with LoRA dropout (A, keep: the input's scaled keep mask, named in
    ``dropped``)."""

    names: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()

    def width(self, name: str) -> int:
        """How many tensors adapter ``name`` has."""
        return 2 if name in INPUT_SIDE or name in self.dropped else 1

    @property
    def count(self) -> int:
        return sum(self.width(n) for n in self.names)

    def split(self, tensors: Sequence[torch.Tensor]
              ) -> tuple[list[torch.Tensor], dict[str, tuple[torch.Tensor, ...]]]:
        """(the schedule's own tensors, {name: its low-rank tensors}) of ``tensors``, whose last
        :attr:`count` are the adapters'."""
        tensors = list(tensors)
        if not self.names:
            return tensors, {}
        own, rest = tensors[:-self.count], tensors[-self.count:]
        out = {}
        for name in self.names:
            k = self.width(name)
            out[name], rest = tuple(rest[:k]), rest[k:]
        return own, out

    def zero_grads(self, low: dict[str, tuple[torch.Tensor, ...]]
                   ) -> dict[str, list[torch.Tensor]]:
        """Zeroed gradient buffers like each adapter's tensors (a keep mask has none)."""
        return {n: [torch.zeros_like(t) for t in (ts if n in INPUT_SIDE else ts[:1])]
                for n, ts in low.items()}

    def grads(self, grads: dict[str, list[torch.Tensor]]) -> list[torch.Tensor | None]:
        """The gradients in the order of the tensors (None for a keep mask)."""
        return [g for n in self.names for g in (*grads[n], *([None] if n in self.dropped
                                                             else []))]


def add_input(out: torch.Tensor, low: tuple[torch.Tensor, ...] | None, rows: slice
              ) -> torch.Tensor:
    """``out`` [..., rows] plus the adapter's ``u @ B[rows]^T`` (``low`` = (u, B), u shaped
    like ``out`` but for its last dim); ``out`` as it is without an adapter."""
    if low is None:
        return out
    u, b = low
    return out + u @ b[rows].t()


def input_backward(d_out: torch.Tensor, low: tuple[torch.Tensor, ...] | None,
                   grads: list[torch.Tensor] | None, rows: slice, tokens: slice = slice(None)
                   ) -> None:
    """Add to ``grads`` (du, dB) the gradients of :func:`add_input` for the tokens ``tokens`` of
    the flat [N, r] ``u``, from ``d_out`` [len(tokens), rows] (nothing without an adapter)."""
    if low is None:
        return
    u, b = low
    du, db = grads
    u2, du2 = u.reshape(-1, u.shape[-1]), du.view(-1, du.shape[-1])
    du2[tokens].addmm_(d_out, b[rows])
    db[rows].addmm_(d_out.t(), u2[tokens])


def _kept(inp: torch.Tensor, low: tuple[torch.Tensor, ...], cols: slice, tokens: slice
          ) -> torch.Tensor:
    """``inp`` [tokens, cols] through the adapter's LoRA dropout (its scaled keep mask, if any)."""
    return inp * low[1][tokens, cols] if len(low) > 1 else inp


def output_part(z: torch.Tensor, inp: torch.Tensor, low: tuple[torch.Tensor, ...] | None,
                cols: slice, tokens: slice = slice(None)) -> None:
    """Add ``drop(inp) @ A[:, cols]^T`` into ``z`` (an output-side adapter's low-rank sum;
    ``inp`` holds the local tokens ``tokens`` of the flat [N, in] input)."""
    if low is not None:
        z.addmm_(_kept(inp, low, cols, tokens), low[0][:, cols].t())


def output_backward(d_inp: torch.Tensor, dz: torch.Tensor, inp: torch.Tensor,
                    low: tuple[torch.Tensor, ...] | None, grads: list[torch.Tensor] | None,
                    cols: slice, tokens: slice = slice(None)) -> torch.Tensor:
    """The backward of :func:`output_part`: ``d_inp += drop'(dz @ A[:, cols])`` (in place, in
    the schedule's fresh ``d_inp``: no second tensor of its size; returned), and
    ``dA[:, cols] += dz^T @ drop(inp)``."""
    if low is None:
        return d_inp
    grads[0][:, cols].addmm_(dz.t(), _kept(inp, low, cols, tokens))
    if len(low) > 1:  # LoRA dropout: the keep mask scales the adapter's share
        return d_inp.add_(_kept(dz @ low[0][:, cols], low, cols, tokens))
    return d_inp.addmm_(dz, low[0][:, cols])


class AddLowRank(torch.autograd.Function):
    """``y += s z B^T`` (``y`` [..., out], the schedule's output; ``z`` [..., r]; ``B`` [out,
    r]) in place, so that an output-side adapter costs no more memory than the base projection
    alone: written as ``y + (z @ B^T) * s``, autograd holds ``z B^T``, ``s z B^T`` and the sum
    beside ``y`` in the forward (three [tokens, out] tensors more) and ``s dy`` in the backward
    (one more). A ``y`` that is a view (which autograd lets no one change in place) gets one
    addmm out of place, and so does a traced one (a compiled layer's graph is functional: the
    compiler plans its buffers). Keeps ``z`` and ``B`` (rank r) for the backward, never ``y``."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, z: torch.Tensor, b: torch.Tensor, scaling: float
                ) -> torch.Tensor:
        ctx.save_for_backward(z, b)
        ctx.scaling = scaling
        z2 = z.reshape(-1, z.shape[-1])
        if traced.tracing() or y._is_view():
            return torch.addmm(y.reshape(-1, y.shape[-1]), z2, b.t(), alpha=scaling
                               ).view(y.shape)
        ctx.mark_dirty(y)
        y.view(-1, y.shape[-1]).addmm_(z2, b.t(), alpha=scaling)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        z, b = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dz = (dy2 @ b).mul_(ctx.scaling).view(z.shape) if ctx.needs_input_grad[1] else None
        db = ((dy2.t() @ z.reshape(-1, z.shape[-1])).mul_(ctx.scaling)
              if ctx.needs_input_grad[2] else None)
        return dy, dz, db, None


class LowRankInputs(torch.autograd.Function):
    """The input-side adapters' ``u_i = s_i x A_i^T`` of one schedule call, and ``x`` passed
    through (a view) for the schedule, so that the adapters' share of the input's gradient,
    ``sum_i s_i du_i A_i``, is added into the gradient the schedule returns for it, in place:
    computed apart (``x @ A^T`` in autograd), each share is a tensor of the input's size that
    autograd then adds to the schedule's out of place (two such tensors more at the backward's
    peak). Keeps ``x`` (which the schedule keeps too) and the ``A_i`` for the backward. Traced,
    ``x`` passes as a copy: dynamo refuses a custom function's output view whose base the layer
    changes in place later."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scalings: tuple[float, ...], *a: torch.Tensor):
        ctx.save_for_backward(x, *a)
        ctx.scalings = scalings
        x2 = x.reshape(-1, x.shape[-1])
        us = [(x2 @ ai.t()).mul_(si).view(*x.shape[:-1], -1) for ai, si in zip(a, scalings)]
        return (x.clone() if traced.tracing() else x.view_as(x), *us)

    @staticmethod
    def backward(ctx, dx: torch.Tensor, *dus: torch.Tensor):
        x, *a = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])
        dx2 = dx.view(-1, dx.shape[-1])  # the schedule's fresh gradient, no one else's
        da = []
        for du, ai, si in zip(dus, a, ctx.scalings):
            du2 = du.reshape(-1, du.shape[-1])
            dx2.addmm_(du2, ai, alpha=si)
            da.append((du2.t() @ x2).mul_(si) if ctx.needs_input_grad[2 + len(da)] else None)
        return (dx, None, *da)


@dataclass(frozen=True)
class AdapterSpec:
    """One named adapter of a projection: its rank, its scale ``s`` (lora_alpha / r, or
    / sqrt(r) with rsLoRA) and its LoRA dropout's p."""

    r: int
    scaling: float
    dropout: float = 0.0


class TSPLoRA(ShardedModule):
    """The LoRA adapters of one projection of a TSP module, in that projection's place:
    ``base_layer`` is the module holding the projection's own (sharded) weight, so its
    parameters keep their names with PEFT's ``base_layer.`` in them, and ``weight`` / ``bias``
    read through to it as PEFT's layers do. Per adapter name (PEFT's ``add_adapter``) a
    ``lora_A[name].weight`` [r, in] and ``lora_B[name].weight`` [out, r], replicated over the
    group; the active adapter (PEFT's ``set_adapter``) adds its term, the others none and get no
    gradient. Disabled (``enable_adapters(False)``, PEFT's ``disable_adapter()``), the
    projection is the base alone. ``base_spec``: this rank's slice of the base weight (its
    host's ShardSpec), which :meth:`merge` adds its share of ``s B A`` to."""

    adapter_layer_names = ("lora_A", "lora_B")
    other_param_names = ("r", "scaling", "lora_dropout")  # per adapter, as PEFT's LoraLayer

    def __init__(self, mesh: TSPMesh, base_layer: nn.Module, adapters: Mapping[str, AdapterSpec],
                 active: str | list[str], in_features: int, out_features: int, *, side: str,
                 base_spec: ShardSpec, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        # PEFT's lora_dropout, on this rank's own tokens with masks of its own; an nn.Dropout, so
        # that what turns a model's dropout off (TRL's disable_dropout_in_model) reaches it
        self.lora_dropout = nn.ModuleDict({n: RankDropoutModule(a.dropout)
                                           for n, a in adapters.items()})
        self.mesh, self.base_layer, self.side = mesh, base_layer, side
        self.base_spec = base_spec
        # PEFT's per-adapter dicts
        self.r = {n: a.r for n, a in adapters.items()}
        self.scaling = {n: float(a.scaling) for n, a in adapters.items()}
        self.in_features, self.out_features = in_features, out_features
        self._active_adapter = active
        self._disable_adapters = False
        self.merged_adapters: list[str] = []
        self.full_shapes = {}
        for n, a in adapters.items():
            self.full_shapes.update({f"lora_A.{n}.weight": (a.r, in_features),
                                     f"lora_B.{n}.weight": (out_features, a.r)})
        self.lora_A, self.lora_B = nn.ModuleDict(), nn.ModuleDict()
        full = {n: torch.zeros(s, dtype=dtype, device=device) for n, s in self.full_shapes.items()}
        self._create(full)

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.base_layer, "bias", None)

    def extra_repr(self) -> str:
        return (f"adapters={sorted(self.r)}, active={self._active_adapter!r}, r={self.r}, "
                f"in_features={self.in_features}, out_features={self.out_features}, "
                f"replicated over tsp_size={self.mesh.size}")

    def shard_spec(self, name: str, rank: int) -> ShardSpec:
        return REPLICATED

    @property
    def adapter(self) -> str:
        """The active adapter's name; several active at once (PEFT's LoraModel.set_adapter with
        a list) are refused: TSP runs one."""
        names = self._active_adapter
        names = [names] if isinstance(names, str) else list(names)
        if len(names) != 1:
            raise NotImplementedError(f"{len(names)} active LoRA adapters {names}: under TSP one "
                                      f"adapter is active at a time; choose it with "
                                      f"set_adapter(name) (docs/lora.md)")
        return names[0]

    @property
    def active(self) -> bool:
        """Whether the active adapter adds its term here: enabled, not merged into the base, and
        one this projection has (an adapter may target other projections only)."""
        return (not self._disable_adapters and not self.merged_adapters
                and self.adapter in self.r)

    def _a(self) -> torch.Tensor:
        return local_replicated(self.lora_A[self.adapter].weight, self.mesh)

    def _b(self) -> torch.Tensor:
        return local_replicated(self.lora_B[self.adapter].weight, self.mesh)

    @property
    def drops(self) -> bool:
        """Whether LoRA dropout acts in this call: training, p > 0 (read at each call)."""
        dropout = self.lora_dropout[self.adapter]
        return self.training and dropout.p > 0

    def schedule_tensors(self, x: torch.Tensor) -> list[torch.Tensor]:
        """What the schedule takes: (u = s drop(x) A^T, B) for an input-side projection of input
        ``x``, (A,) for an output-side one, (A, keep) with LoRA dropout (keep: [tokens, in], the
        dropout's keep mask over 1 - p, for the input the schedule computes); in ``x``'s dtype."""
        dropout = self.lora_dropout[self.adapter]
        if self.side == "input":
            u = dropout(x) @ self._a().to(x.dtype).t()
            return [u * self.scaling[self.adapter], self._b().to(x.dtype)]
        if not self.drops:
            return [self._a().to(x.dtype)]
        tokens = x.shape[:-1].numel()
        keep = dropout.masks.mask(x.new_empty(tokens, self.in_features), dropout.p)
        return [self._a().to(x.dtype), keep.to(x.dtype) / (1.0 - dropout.p)]

    def add_output(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``y + s z B^T``: the schedule's output ``y`` with an output-side adapter's term from
        the schedule's ``z``, added in place (:class:`AddLowRank`)."""
        return AddLowRank.apply(y, z, self._b().to(y.dtype), self.scaling[self.adapter])

    def _merge_targets(self) -> list[tuple[nn.Parameter, ShardSpec, slice]]:
        """(base weight, this rank's ShardSpec of it, its rows in ``B``) of what :meth:`merge`
        adds to: the projection's weight, all of ``B``'s rows."""
        return [(self.base_layer.weight, self.base_spec, slice(None))]

    @torch.no_grad()
    def merge(self, safe_merge: bool = False, adapter_names: Sequence[str] | None = None
              ) -> None:
        """Add the active adapter's ``s B A`` into the base weight, each rank only its own slice
        of it (rows of ``B`` or columns of ``A`` by the base's ShardSpec: no collective, no
        full-size product); the adapter is then inactive (merged). PEFT's signature;
        ``safe_merge`` checks the merged slices for NaN or inf first."""
        if self.merged_adapters:
            return
        name = self.adapter if not adapter_names else _one(adapter_names)
        a_full = local(self.lora_A[name].weight)
        merged = []
        for param, spec, rows in self._merge_targets():
            a, b = a_full, local(self.lora_B[name].weight)[rows]
            if spec.dim == 0:
                b = b[spec.start:spec.start + spec.length]
            elif spec.dim == 1:
                a = a[:, spec.start:spec.start + spec.length]
            weight = local(param)
            if not weight.is_floating_point():  # NF4 codes (QLoRA: tsp_core/layers/nf4.py)
                raise NotImplementedError(f"merging into a {weight.dtype} base (4-bit NF4) is "
                                          f"not supported: docs/lora.md \"QLoRA\"")
            own = weight if spec.dim is None else weight.narrow(spec.dim, 0, spec.length)
            merged.append((own, own + ((b @ a) * self.scaling[name]).to(own.dtype)))
        if safe_merge and not all(torch.isfinite(m).all() for _, m in merged):
            raise ValueError(f"merging the adapter {name!r} gives NaN or inf weights")
        for own, m in merged:
            own.copy_(m)
        self.merged_adapters = [name]


def _one(names: Sequence[str]) -> str:
    """The one adapter name of ``names`` (merging several at once is refused)."""
    if len(names) != 1:
        raise NotImplementedError(f"merging {len(names)} adapters {list(names)} at once is not "
                                  f"supported under TSP: merge one (docs/lora.md)")
    return names[0]


class FusedParts(nn.Module):
    """What a fused projection's adapter wraps (its ``base_layer``): the TSP module's part
    projections (Phi-3's ``q_proj``, ``k_proj``, ``v_proj`` of ``qkv_proj``), referred to, not
    held: they stay the TSP module's own parameters, under their own names."""

    def __init__(self, fused: str, parts: Mapping[str, nn.Module]) -> None:
        super().__init__()
        self.fused = fused
        self.parts = dict(parts)  # a plain dict: not registered, so not named twice

    def extra_repr(self) -> str:
        return f"{self.fused}: the TSP module's {', '.join(self.parts)}"


class TSPFusedLoRA(TSPLoRA):
    """The LoRA adapters of a projection Hugging Face fuses and TSP keeps apart (Phi-3's
    ``qkv_proj``, ``gate_up_proj``), in the fused projection's place in the TSP module, PEFT's
    names and shapes: ``lora_A`` [r, in] whole, ``lora_B`` [sum of the parts' rows, r]. Its term
    ``s B A x`` splits exactly by ``B``'s rows: each part (``rows``: part -> its rows of ``B``)
    is an input-side adapter with the same ``u = s drop(x) A^T`` (one dropout mask, as PEFT's)
    and its rows of ``B``, so the schedules take it as they take q/k/v or gate/up adapters
    (:meth:`part_tensors`); the parts' gradients of ``u`` and of ``B``'s rows sum into ``A``'s
    and ``B``'s. ``specs``: this rank's ShardSpec of each part's weight (for :meth:`merge`)."""

    def __init__(self, mesh: TSPMesh, base_layer: FusedParts, adapters: Mapping[str, AdapterSpec],
                 active: str | list[str], in_features: int, rows: Mapping[str, int], *,
                 specs: Mapping[str, ShardSpec], dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__(mesh, base_layer, adapters, active, in_features, sum(rows.values()),
                         side="input", base_spec=REPLICATED, dtype=dtype, device=device)
        self.rows, start = {}, 0
        for part, n in rows.items():
            self.rows[part], start = slice(start, start + n), start + n
        self.specs = dict(specs)

    @property
    def weight(self) -> torch.Tensor:
        raise AttributeError(f"{self.base_layer.fused} has no weight of its own under TSP: its "
                             f"parts {list(self.rows)} are the TSP module's")

    @property
    def bias(self) -> None:
        return None

    def part_tensors(self, x: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        """Each part's input-side tensors (u, its rows of B), ``u`` computed once."""
        u, b = self.schedule_tensors(x)
        return {part: [u, b[rows]] for part, rows in self.rows.items()}

    def _merge_targets(self) -> list[tuple[nn.Parameter, ShardSpec, slice]]:
        return [(self.base_layer.parts[p].weight, self.specs[p], rows)
                for p, rows in self.rows.items()]


def schedule_adapters(module: nn.Module, names: Sequence[str], x: torch.Tensor
                      ) -> tuple[torch.Tensor, LowRank | None, list[torch.Tensor],
                                 dict[str, TSPLoRA]]:
    """The schedule's input and the active adapters among ``module``'s projections ``names``
    (in that order), a fused projection's adapter (:class:`TSPFusedLoRA`) giving one per part:
    their :class:`LowRank`, the tensors the schedule takes after its weights, and the adapters by
    name (an output-side one adds :meth:`TSPLoRA.add_output` of its ``z``). The input is ``x``
    passed through :class:`LowRankInputs` when input-side adapters without dropout compute their
    ``u`` there; ``x`` itself, None and nothing without an active adapter: the schedule runs
    exactly as without LoRA."""
    # plain loops: an assignment expression in a comprehension breaks a torch.compile graph
    parts = {}
    for fused in getattr(module, "fused", {}):
        m = getattr(module, fused, None)
        if isinstance(m, TSPFusedLoRA) and m.active:
            parts.update({p: (m, ts) for p, ts in m.part_tensors(x).items()})
    found, tensors = {}, []
    for n in names:
        m = getattr(module, n, None)
        if n in parts:
            found[n], part = parts[n]
            tensors.append(part)
        elif isinstance(m, TSPLoRA) and m.active:
            found[n] = m
            tensors.append(None if _joins_inputs(m) else m.schedule_tensors(x))
    if not found:
        return x, None, [], {}
    x, tensors = _input_side(x, list(found.values()), tensors)
    dropped = tuple(n for n, m in found.items()
                    if isinstance(m, TSPLoRA) and m.side == "output" and m.drops)
    return x, LowRank(tuple(found), dropped), [t for ts in tensors for t in ts], found


def _joins_inputs(m: TSPLoRA) -> bool:
    """Whether adapter ``m``'s ``u`` is computed in :class:`LowRankInputs`: an input-side one
    without LoRA dropout in this call (one that drops draws its own mask of the input)."""
    return m.side == "input" and not m.drops


def _input_side(x: torch.Tensor, adapters: list[TSPLoRA], tensors: list[list | None]
                ) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """The schedule's input and every adapter's tensors, those left None (:func:`_joins_inputs`)
    filled with (u, B) from one :class:`LowRankInputs` call."""
    joined = [i for i, ts in enumerate(tensors) if ts is None]
    if not joined:
        return x, tensors
    a = [adapters[i]._a().to(x.dtype) for i in joined]
    scalings = tuple(adapters[i].scaling[adapters[i].adapter] for i in joined)
    x, *us = LowRankInputs.apply(x, scalings, *a)
    for i, u in zip(joined, us):
        tensors[i] = [u, adapters[i]._b().to(x.dtype)]
    return x, tensors


# ------------------------------------------------- decode steps (tsp_core.inference.decode)

def decode_adapter(module: nn.Module, name: str) -> tuple[TSPLoRA, ShardSpec, slice] | None:
    """The active adapter on projection ``name`` of TSP module ``module`` in a decode step: (the
    adapter, this rank's ShardSpec of the projection's base weight, the rows of ``B`` that are
    the projection's); a fused projection's adapter (:class:`TSPFusedLoRA`) is found through
    its part. None without one (disabled, merged, or the active adapter not on it)."""
    for fused in getattr(module, "fused", {}):
        m = getattr(module, fused, None)
        if isinstance(m, TSPFusedLoRA) and m.active and name in m.rows:
            return m, m.specs[name], m.rows[name]
    m = getattr(module, name, None)
    if isinstance(m, TSPLoRA) and m.active:
        return m, m.base_spec, slice(None)
    return None


def _decode_ab(m: TSPLoRA, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The active adapter's full ``A``, ``B`` (replicated: this rank's copy) and scale."""
    name = m.adapter
    return (local(m.lora_A[name].weight).to(dtype), local(m.lora_B[name].weight).to(dtype),
            m.scaling[name])


def decode_rows(module: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor | None:
    """This rank's rows of the adapter term ``s B A x`` of input-side projection ``name`` for a
    decode step's ``x`` [B, in] (the same on every rank), zero in rows the base's shard pads:
    what to add to ``x W_rows^T``. ``A`` and ``B`` are replicated and ``x`` is on every rank, so
    nothing moves; None without an active adapter. No LoRA dropout: generation runs in eval
    (training with dropout on is refused before it)."""
    found = decode_adapter(module, name)
    if found is None:
        return None
    m, spec, rows = found
    a, b, s = _decode_ab(m, x.dtype)
    b = b[rows]
    if spec.dim is not None:  # rows of the output (q/k/v, gate/up)
        b = b.narrow(0, spec.start, spec.length)
    out = ((x @ a.t()) * s) @ b.t()
    pad = spec.local_len - spec.length if spec.dim is not None else 0
    return torch.nn.functional.pad(out, (0, pad)) if pad > 0 else out


def decode_share(module: nn.Module, name: str, inp: torch.Tensor) -> torch.Tensor | None:
    """This rank's share of the adapter term ``s B A inp`` of output-side projection ``name``
    (o_proj, down_proj) in a decode step: ``inp`` [B, this rank's columns] (its heads' merged
    output, its channels) through its columns of ``A``, then all of ``B``. The ranks' shares
    sum to the term, so it is added to this rank's partial product before the projection's own
    all-reduce: no byte and no collective more (an all-reduce of ``z`` [B, r] apart would be
    one more collective per projection). None without an active adapter."""
    found = decode_adapter(module, name)
    if found is None:
        return None
    m, spec, _ = found
    a, b, s = _decode_ab(m, inp.dtype)
    if spec.dim is not None:
        a = a.narrow(1, spec.start, spec.length)
    return ((inp[:, :a.shape[1]] @ a.t()) * s) @ b.t()
