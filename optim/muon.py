"""K2's Muon update for weight matrices (docs/k2_reference.md "Optimizer"; K2 report section 2.1 "MuonClip",
Algorithm 1; "Muon is Scalable for LLM Training" section 2, eq. 3-4).

For one weight matrix ``W`` of shape ``A x B`` with gradient ``G`` at step ``t``::

    M_t = mu * M_{t-1} + G_t                                  (momentum, mu = 0.95)
    N_t = G_t + mu * M_t                                      (Nesterov)
    O_t = NS5(N_t / ||N_t||_F) * 0.2 * sqrt(max(A, B))        (orthogonalise, match AdamW's update RMS)
    W_t = W_{t-1} - lr * (O_t + wd * W_{t-1})                 (decoupled weight decay, same lr)

NS5 is the quintic Newton-Schulz iteration ``X <- a X + (b X X^T + c (X X^T)^2) X`` with
``(a, b, c) = (3.4445, -4.7750, 2.0315)`` ("simple"), five steps, in bf16.

What is reused and what is ours:

* emerging-optimizers' ``Muon`` (base of :class:`K2Muon`) does the momentum, the Nesterov step, the
  decoupled weight decay and the parameter update, and its ``newton_schulz`` does the iteration with the
  coefficient sets and the bf16 cast (``fp32_matmul_prec="medium"``). It keeps the momentum as an EMA,
  ``(1 - mu)`` times the sum above; the normalisation before NS removes that factor, so the direction
  is the same.
* Ours: (1) the normalisation before NS. emerging-optimizers divides by ``max(||X||_F, 1e-7)``; a
  momentum whose norm is below ~1e-7 (the EMA makes it 20x smaller than K2's sum) then enters NS with
  norm << 1, NS leaves it far from orthogonal, and the update silently shrinks instead of having the
  RMS-matched size. :func:`k2_orthogonalize` divides by the max |entry| first, so NS always sees
  ``||X||_F >= 1`` and the result is scale-invariant down to fp32's smallest numbers. (2) The matrix
  boundaries (:meth:`K2Muon.orthogonalize`): a tensor that *stores* several of the reference model's
  matrices is split before NS -- megatron's fused SwiGLU ``linear_fc1`` (``[gate; up]`` stacked on the
  output dim), a fused ``linear_qkv`` (per query group ``[q; k; v]``), and stacked expert weights
  ``[E, out, in]`` (each expert separately). megatron's own ``TensorParallelMuon`` orthogonalises
  ``linear_fc1`` as one ``2*ffn x h`` matrix, and reads its QKV split from a parameter attribute that
  megatron's bf16 optimizer does not copy to the fp32 master copy it actually steps (so in bf16 the QKV
  is not split either); here the split travels with the master copy (:func:`k2.optim.params.tag_matrices`
  and :func:`k2.optim.build.build_optimizer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from emerging_optimizers.orthogonalized_optimizers import muon_utils
from emerging_optimizers.orthogonalized_optimizers.muon import Muon, get_muon_scale_factor

#: Parameter attribute holding a :class:`MatrixSplit` (absent = the tensor is one matrix, or a stack of
#: matrices along dim 0 when it is 3-D).
SPLIT_ATTR = "k2_matrix_split"


@dataclass(frozen=True)
class MatrixSplit:
    """How the rows of a stored 2-D weight ``[rows, in]`` split into separate matrices.

    The rows are viewed as ``[groups, sum(sizes), in]``; matrix ``i`` is the slice ``sizes[i]`` of the
    middle dim of every group, i.e. a ``[groups * sizes[i], in]`` matrix.

    * SwiGLU ``linear_fc1`` (megatron stores ``[gate; up]``): ``MatrixSplit(1, (ffn, ffn))``.
    * fused ``linear_qkv`` with ``g`` query groups of ``r`` heads of dim ``d``:
      ``MatrixSplit(g, (r * d, d, d))`` -> ``W_q``, ``W_k``, ``W_v``.
    """

    groups: int
    sizes: tuple[int, ...]

    def parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The matrices of ``x`` (``[groups * sum(sizes), in]``), each ``[groups * size, in]``.

        Raises:
            ValueError: ``x`` is not 2-D or its rows are not ``groups * sum(sizes)``.
        """
        if x.ndim != 2 or x.shape[0] != self.groups * sum(self.sizes):
            raise ValueError(f"{self} does not fit a tensor of shape {tuple(x.shape)}")
        rows = x.reshape(self.groups, sum(self.sizes), x.shape[1])
        return [p.reshape(-1, x.shape[1]) for p in torch.split(rows, list(self.sizes), dim=1)]

    def join(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`parts`: ``[groups * sum(sizes), in]``."""
        cols = parts[0].shape[1]
        grouped = [p.reshape(self.groups, -1, cols) for p in parts]
        return torch.cat(grouped, dim=1).reshape(-1, cols)


def newton_schulz_gemms(m: int, n: int) -> list[tuple[int, int, int]]:
    """The GEMMs ``(m, k, n)`` (``[m, k] x [k, n]``) of one quintic Newton-Schulz iteration on an ``[m, n]``
    matrix ``X``, ``m <= n``:
    ``A = X X^T`` (``[m, n] x [n, m]``), ``A A`` (``[m, m] x [m, m]``) and ``B X`` (``[m, m] x [m, n]``), in
    all ``4 m^2 n + 2 m^3`` FLOPs (Keller Jordan's Muon; Moonlight, arXiv 2502.16982). ``k2-plan`` prices them
    as GEMMs (:mod:`k2.launcher.planning.kernels`)."""
    return [(m, n, m), (m, m, m), (m, m, n)]


def k2_orthogonalize(
    x: torch.Tensor,
    steps: int = 5,
    coefficient_type: str = "simple",
    scale_mode: str = "spectral",
    extra_scale_factor: float = 0.2,
) -> torch.Tensor:
    """Orthogonalised, RMS-matched update of one matrix: ``NS(x / ||x||_F) * extra * scale(A, B)``.

    Args:
        x: ``[A, B]`` fp32 (the Nesterov momentum of one matrix).
        steps: Newton-Schulz iterations (K2: 5).
        coefficient_type: emerging-optimizers coefficient set (K2: ``"simple"`` = (3.4445, -4.7750,
            2.0315)).
        scale_mode: emerging-optimizers' ``get_muon_scale_factor`` mode; ``"spectral"`` is
            ``sqrt(max(A, B))``.
        extra_scale_factor: multiplies the scale (K2: 0.2, so the update RMS matches AdamW's).

    Returns:
        ``[A, B]`` fp32; all zeros when ``x`` is all zeros. NS runs in bf16 when the fp32 matmul
        precision is ``"medium"`` (the optimizer sets it), else in fp32.

    Raises:
        ValueError: ``x`` is not 2-D.
    """
    if x.ndim != 2:
        raise ValueError(f"k2_orthogonalize takes one matrix [A, B], got shape {tuple(x.shape)}")
    x = x.float()
    amax = x.abs().amax()
    if amax == 0:
        return torch.zeros_like(x)
    # max |entry| = 1 -> 1 <= ||x||_F <= sqrt(A*B): emerging-optimizers' eps (1e-7) is then negligible
    # and its Frobenius normalisation makes NS's input exactly scale-free.
    orth = muon_utils.newton_schulz(x / amax, steps=steps, coefficient_type=coefficient_type)
    return orth * (get_muon_scale_factor(x.shape[0], x.shape[1], mode=scale_mode) * extra_scale_factor)


class K2Muon(Muon):
    """Muon with K2's settings and matrix boundaries (see the module docstring for the update rule).

    Takes 2-D parameters (one matrix, or several when the parameter carries a :class:`MatrixSplit` in
    :data:`SPLIT_ATTR`) and 3-D parameters ``[E, out, in]`` (E stacked matrices, each orthogonalised
    on its own). The RMS-matching scale uses the shape of each matrix actually orthogonalised.

    Args:
        params: parameters or param groups (megatron groups carry ``lr``/``weight_decay``, set by the
            LR scheduler every step).
        lr: initial learning rate.
        momentum: ``mu`` (K2: 0.95).
        weight_decay: decoupled weight decay (K2: 0.1), applied as ``W -= lr * wd * W``.
        nesterov: Nesterov momentum (K2: True).
        coefficient_type, num_ns_steps, scale_mode, extra_scale_factor: see :func:`k2_orthogonalize`.
        fp32_matmul_prec: ``"medium"`` runs NS in bf16 (K2), ``"highest"`` in fp32.
    """

    def __init__(
        self,
        params,
        lr: float = 3e-4,
        momentum: float = 0.95,
        weight_decay: float = 0.1,
        *,
        nesterov: bool = True,
        coefficient_type: str = "simple",
        num_ns_steps: int = 5,
        scale_mode: str = "spectral",
        extra_scale_factor: float = 0.2,
        fp32_matmul_prec: str = "medium",
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            nesterov=nesterov,
            weight_decay_method="decoupled",
            fp32_matmul_prec=fp32_matmul_prec,
            coefficient_type=coefficient_type,
            num_ns_steps=num_ns_steps,
            scale_mode=scale_mode,
            extra_scale_factor=extra_scale_factor,
        )

        def scaled_orthogonalize_fn(grad: torch.Tensor) -> torch.Tensor:
            return k2_orthogonalize(grad, num_ns_steps, coefficient_type, scale_mode, extra_scale_factor)

        self.scaled_orthogonalize_fn = scaled_orthogonalize_fn

    def orthogonalize(self, p: torch.Tensor, grad: torch.Tensor, **kwargs) -> torch.Tensor:
        """Orthogonalised update of parameter ``p`` from its Nesterov momentum ``grad`` (same shape).

        Raises:
            ValueError: ``p`` is neither 2-D nor 3-D, or its :class:`MatrixSplit` does not fit.
        """
        split: MatrixSplit | None = getattr(p, SPLIT_ATTR, None)
        if grad.ndim == 3:  # [E, out, in]: every expert's matrix on its own
            return torch.stack([self._one(grad[e], split) for e in range(grad.shape[0])])
        if grad.ndim != 2:
            raise ValueError(f"K2Muon takes 2-D or stacked 3-D weights, got shape {tuple(grad.shape)}")
        return self._one(grad, split)

    def _one(self, g: torch.Tensor, split: MatrixSplit | None) -> torch.Tensor:
        if split is None:
            return self.scaled_orthogonalize_fn(g)
        return split.join([self.scaled_orthogonalize_fn(part) for part in split.parts(g)])
