"""A batch's sampling settings as device tensors, sent in one copy (kiln.engine.host_upload): the
sampler's filters read them instead of making one small host-to-device tensor each."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kiln.engine.host_upload import upload
from kiln.engine.sampling_params import SamplingParams


@dataclass
class RowSettings:
    """Per row of an [N, vocab] batch (greedy rows: temperature 1, no filter):
    temps float32 [N]; greedy bool [N]; min_p_floor float32 [N] (log(min_p), -inf when off);
    top_k int64 [N] (0 when off, or when k >= vocab); nucleus int64 [R], the rows with top_p < 1, and
    their top_p float64 [R]. On the host: max_top_k (0: no row filters by top-k), whether any row
    filters at all, and whether every nucleus row has a top-k too."""

    temps: torch.Tensor
    greedy: torch.Tensor
    min_p_floor: torch.Tensor
    top_k: torch.Tensor
    nucleus: torch.Tensor
    top_p: torch.Tensor
    max_top_k: int
    filters: bool
    nucleus_within_top_k: bool

    @classmethod
    def of(cls, params: list[SamplingParams], vocab: int, device: torch.device) -> RowSettings:
        sampling = [not p.greedy for p in params]
        top_k = [p.top_k if s and 0 < p.top_k < vocab else 0 for p, s in zip(params, sampling, strict=True)]
        nucleus = [i for i, (p, s) in enumerate(zip(params, sampling, strict=True)) if s and p.top_p < 1.0]
        min_p = [p.min_p if s else 0.0 for p, s in zip(params, sampling, strict=True)]
        # min-p: p_i >= min_p * p_top  <=>  scaled_i >= log(min_p), the top token's scaled logit being 0
        floors = [math.log(m) if m > 0 else -math.inf for m in min_p]
        tensors = upload(
            device,
            [
                np.array([p.temperature if not p.greedy else 1.0 for p in params], dtype=np.float32),
                np.array([p.greedy for p in params], dtype=np.bool_),
                np.array(floors, dtype=np.float32),
                np.array(top_k, dtype=np.int64),
                np.array(nucleus, dtype=np.int64),
                np.array([params[i].top_p for i in nucleus], dtype=np.float64),
            ],
        )
        return cls(
            *tensors,
            max_top_k=max(top_k, default=0),
            filters=any(top_k) or bool(nucleus) or any(m > 0 for m in min_p),
            nucleus_within_top_k=all(top_k[i] for i in nucleus),
        )
