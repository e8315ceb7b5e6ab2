"""Step-by-step KDA reference, computed in fp32 (or fp64 when the inputs are fp64).

    S_t = (I − β_t k_t k_tᵀ) · Diag(α_t) · S_{t−1} + β_t k_t v_tᵀ,     o_t = S_tᵀ (scale · q_t),   g = log α.

Shapes follow fla: q, k ``[B, T, H, K]``; v ``[B, T, H, V]``; g ``[B, T, H, K]``; beta ``[B, T, H]``;
states ``[N, H, K, V]``.
"""

from __future__ import annotations

import torch

from k3.ops.kda.args import check_kda_inputs, expand_gva

__all__ = ["naive_recurrent_kda", "naive_chunk_kda", "naive_chunk_kda_summary", "chunk_scan_states"]


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA (fla's ``naive_recurrent_kda``; v may have a multiple of q's heads, fla's GVA).
    Returns ``(o [B,T,HV,V] in v.dtype, final_state [B,HV,K,V] fp32 (fp64 for fp64 inputs) or None)``."""
    q, k = expand_gva(q, k, v)
    B, T, H, K, V = check_kda_inputs(q, k, v, g, beta, initial_state=initial_state)
    if scale is None:
        scale = K**-0.5
    out_dtype = v.dtype
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (x.to(acc) for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(acc).clone()
    o = q.new_empty(B, T, H, V)
    for t in range(T):
        S = S * g[:, t].exp()[..., None]  # Diag(α_t) S
        k_t, v_t, b_t = k[:, t], v[:, t], beta[:, t]
        r = v_t - torch.einsum("bhk,bhkv->bhv", k_t, S)  # residual v − Sᵀk
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, b_t[..., None] * r)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S)
    final = S.float() if acc == torch.float32 else S
    return o.to(out_dtype), (final if output_final_state else None)


# ----------------------------------------------------------------------------------------------------------------
# Chunked form (``docs/kda-kernels.md``), plain PyTorch, differentiable by autograd.
#
# Letters: B batch, N sequences, T tokens, n chunks, C chunk size, H heads, K key dim, V value dim.
# Varlen batches are turned into a padded batch [N, T_pad] with padding only at each sequence's END: a padded token
# has k = v = β = 0 and g = 0, so it neither decays nor updates the state and the final state stays exact.
# ----------------------------------------------------------------------------------------------------------------


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def varlen_pad_index(cu_seqlens: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Gather map from a packed stream to a tail-padded batch.

    Returns ``(src [N, T_pad] long, dst [T_total] long, T_pad)``: ``padded = ext[src]`` where ``ext`` is the packed
    stream with one zero row appended (index ``T_total``), and ``packed = padded.flatten(0, 1)[dst]``.
    """
    cs = [int(c) for c in cu_seqlens.detach().cpu().tolist()]
    lens = [b - a for a, b in zip(cs[:-1], cs[1:])]
    total = cs[-1]
    T_pad = max(1, -(-max(lens + [1]) // chunk_size)) * chunk_size
    pos = torch.arange(T_pad)
    start = torch.tensor(cs[:-1], dtype=torch.long)[:, None]
    length = torch.tensor(lens, dtype=torch.long)[:, None]
    src = torch.where(pos[None] < length, start + pos[None], torch.full_like(pos[None], total))
    dst = (torch.cat([n * T_pad + torch.arange(L) for n, L in enumerate(lens)]) if total
           else torch.zeros(0, dtype=torch.long))
    return src, dst.long(), T_pad


def _to_padded(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``x [1, T_total, ...]`` → ``[N, T_pad, ...]`` with zero tail padding (differentiable gather)."""
    ext = torch.cat([x[0], x.new_zeros((1,) + tuple(x.shape[2:]))], 0)
    return ext[src.to(x.device)]


def _from_padded(y: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``y [N, T_pad, ...]`` → ``[1, T_total, ...]``."""
    return y.flatten(0, 1)[dst.to(y.device)][None]


def _pad_tail(x: torch.Tensor, T_pad: int) -> torch.Tensor:
    """Zero-pad dim 1 of ``x [B, T, ...]`` to ``T_pad``."""
    T = x.shape[1]
    if T == T_pad:
        return x
    return torch.cat([x, x.new_zeros((x.shape[0], T_pad - T) + tuple(x.shape[2:]))], 1)


def _chunk_tensors(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float, C: int
) -> dict[str, torch.Tensor]:
    """Per-chunk intra quantities for ``[B, T, H, *]`` inputs with ``T % C == 0`` (all exponents ≤ 0).

    Returns tensors laid out ``[B, H, n, C, *]``: ``W, U`` (WY form), ``kg = K⊙e^{G_C−G}``, ``qg = scale·Q⊙e^{G}``,
    ``Aqk`` ``[.., C, C]``, ``decay = e^{G_C}`` ``[B, H, n, K]``.
    """
    B, T, H, K = q.shape
    n = T // C

    def blk(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, *] → [B, H, n, C, *]
        return x.reshape(B, n, C, H, -1).permute(0, 3, 1, 2, 4)

    q, k, v, g = blk(q), blk(k), blk(v), blk(g)
    b = beta.reshape(B, n, C, H).permute(0, 3, 1, 2)  # [B, H, n, C]
    G = g.cumsum(-2)  # within-chunk cumulative log-decay, fp32/fp64
    # Decay between rows i ≥ j as a segment sum Σ_{j<s≤i} g_s rather than G_i − G_j: the difference of two large
    # cumsums (≈ −300 at the bound) loses ~1e-5 relative accuracy in fp32, the direct sum does not. The upper
    # triangle is set to −inf BEFORE exp so no inf appears (an inf would turn into NaN gradients through the mask).
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    seg = g[..., :, None, :].expand(*g.shape[:-2], C, C, g.shape[-1]).masked_fill(~strict[..., None], 0.0).cumsum(-3)
    E = seg.masked_fill(~causal[..., None], float("-inf")).exp()  # [B, H, n, C, C, K], entries ≤ 1
    Aqk = (q[..., :, None, :] * k[..., None, :, :] * E).sum(-1) * scale
    Akk = ((k[..., :, None, :] * k[..., None, :, :] * E).sum(-1) * b[..., None]).masked_fill(~strict, 0.0)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    L = Akk + eye  # unit lower triangular; T = L^{-1}
    W = torch.linalg.solve_triangular(L, k * G.exp() * b[..., None], upper=False, unitriangular=True)
    U = torch.linalg.solve_triangular(L, v * b[..., None], upper=False, unitriangular=True)
    # G_C − G_i = Σ_{s>i} g_s, again as a direct (reverse) sum for accuracy.
    rest = torch.cat([g[..., 1:, :].flip(-2).cumsum(-2).flip(-2), torch.zeros_like(g[..., :1, :])], -2)
    return {"W": W, "U": U, "kg": k * rest.exp(), "qg": q * G.exp() * scale, "Aqk": Aqk,
            "decay": G[..., -1, :].exp()}


def _chunk_scan(
    ct: dict[str, torch.Tensor], S: torch.Tensor, want_output: bool = True, entries: list | None = None
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Sequential pass over chunks from state ``S [B, H, K, V]``: ``V' = U − W S``; ``O = Q_g S + A_qk V'``;
    ``S ← Diag(e^{G_C}) S + K_gᵀ V'``. Returns ``(O [B, H, n, C, V] or None, final S)``; ``entries``, if given,
    collects the state entering each chunk."""
    outs = []
    for i in range(ct["W"].shape[2]):
        if entries is not None:
            entries.append(S)
        vn = ct["U"][:, :, i] - ct["W"][:, :, i] @ S
        if want_output:
            outs.append(ct["qg"][:, :, i] @ S + ct["Aqk"][:, :, i] @ vn)
        S = ct["decay"][:, :, i, :, None] * S + ct["kg"][:, :, i].transpose(-1, -2) @ vn
    return (torch.stack(outs, 2) if want_output else None), S


def naive_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA in plain PyTorch (fp32 inside, fp64 for fp64 inputs), differentiable by autograd; fla's
    ``naive_chunk_kda`` (same positional order), for any T and packed varlen batches as well.

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` (HV a multiple of H, fla's GVA); g = log α ``[B, T, HV, K]`` (≤ 0);
    beta ``[B, T, HV]`` (post-sigmoid); initial_state ``[N, HV, K, V]``; ``cu_seqlens [N+1]`` packs N sequences along
    T (B must be 1). Returns ``(o [B, T, HV, V] in v.dtype, final_state [N, HV, K, V] fp32 (fp64 for fp64 inputs) or
    None)``.
    """
    o, S, _ = chunk_scan_states(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, keep_entries=False)
    return o, (S if output_final_state else None)


def chunk_scan_states(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int,
    keep_entries: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`naive_chunk_kda`'s work: ``(o, final states, h)`` with ``h`` the state entering every chunk,
    ``[B, ⌈T/C⌉, H, K, V]`` (varlen: ``[1, Σ_n ⌈T_n/C⌉, H, K, V]``, sequence-major) in the accumulation dtype, or
    None without ``keep_entries``."""
    q, k = expand_gva(q, k, v)
    B, T, H, K, V = check_kda_inputs(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens)
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, got {chunk_size}")
    scale = K**-0.5 if scale is None else float(scale)
    out_dtype, acc = v.dtype, _acc_dtype(q)
    if B == 0:  # an empty batch: nothing to scan (the chunk reshapes below cannot infer sizes from 0 elements);
        # the 0·Σ terms keep the empty outputs in the autograd graph, as for any other batch
        S = q.new_zeros(0, H, K, V, dtype=acc) if initial_state is None else initial_state.to(acc)
        o = v.new_zeros(0, T, H, V, dtype=out_dtype) + 0 * (q.sum() + k.sum() + v.sum() + g.sum() + beta.sum())
        h = q.new_zeros(0, -(-T // chunk_size), H, K, V, dtype=acc) if keep_entries else None
        return o, S + 0 * o.sum(), h
    q, k, v, g, beta = (x.to(acc) for x in (q, k, v, g, beta))
    if cu_seqlens is not None:
        src, dst, T_pad = varlen_pad_index(cu_seqlens, chunk_size)
        q, k, v, g, beta = (_to_padded(x, src) for x in (q, k, v, g, beta))
    else:
        T_pad = max(1, -(-T // chunk_size)) * chunk_size
        q, k, v, g, beta = (_pad_tail(x, T_pad) for x in (q, k, v, g, beta))
    N = q.shape[0]
    S0 = q.new_zeros(N, H, K, V) if initial_state is None else initial_state.to(acc)
    ct = _chunk_tensors(q, k, v, g, beta, scale, chunk_size)
    entries: list | None = [] if keep_entries else None
    O, S = _chunk_scan(ct, S0, entries=entries)
    o = O.permute(0, 2, 3, 1, 4).reshape(N, T_pad, H, V)  # [N, H, n, C, V] → [N, T_pad, H, V]
    o = _from_padded(o, dst) if cu_seqlens is not None else o[:, :T]
    h = None
    if keep_entries:
        h = torch.stack(entries, 1)  # [N, n, H, K, V]
        if cu_seqlens is not None:
            cs = [int(c) for c in cu_seqlens.detach().cpu().tolist()]
            h = torch.cat([h[i, :-(-(b - a) // chunk_size)] for i, (a, b) in enumerate(zip(cs[:-1], cs[1:]))])[None]
        else:
            h = h[:, :-(-T // chunk_size)]
    return o.to(out_dtype), S, h


def naive_chunk_kda_summary(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Affine span summaries: the state leaving each sequence is ``S_out = M · S_in + S_ext``.

    Per chunk ``M_c = Diag(e^{G_C}) − (K ⊙ e^{G_C − G})ᵀ W`` and spans compose as
    ``(M₂, E₂)∘(M₁, E₁) = (M₂M₁, M₂E₁ + E₂)``; ``S_ext`` is the span's final state from ``S_in = 0``.
    Inputs as :func:`naive_chunk_kda` (q is not needed). Returns ``(M [N, H, K, K], S_ext [N, H, K, V])`` in fp32
    (fp64 for fp64 inputs), differentiable.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    acc = _acc_dtype(k)
    k, v, g, beta = (x.to(acc) for x in (k, v, g, beta))
    if cu_seqlens is not None:
        src, _, T_pad = varlen_pad_index(cu_seqlens, chunk_size)
        k, v, g, beta = (_to_padded(x, src) for x in (k, v, g, beta))
    else:
        T_pad = max(1, -(-T // chunk_size)) * chunk_size
        k, v, g, beta = (_pad_tail(x, T_pad) for x in (k, v, g, beta))
    N = k.shape[0]
    ct = _chunk_tensors(k, k, v, g, beta, 1.0, chunk_size)  # q is unused by the summary: pass k
    M = torch.eye(K, dtype=acc, device=k.device).expand(N, H, K, K)
    for i in range(ct["W"].shape[2]):
        Mc = torch.diag_embed(ct["decay"][:, :, i]) - ct["kg"][:, :, i].transpose(-1, -2) @ ct["W"][:, :, i]
        M = Mc @ M
    _, S_ext = _chunk_scan(ct, k.new_zeros(N, H, K, V), want_output=False)
    return M.contiguous(), S_ext
