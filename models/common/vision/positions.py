"""Positions and input checks of the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL): pure torch functions,
no collectives, no transformers import.

Qwen2-VL rotates the language model's queries and keys with multimodal RoPE (M-RoPE): every token
carries three positions (temporal, height, width). Text tokens have the same value in all three;
the tokens of one image or video take a grid of positions starting where the text before it left
off, and the text after it resumes at that start plus the larger of its merged height and width.
``mrope_positions`` reproduces transformers' ``Qwen2VLModel.get_rope_index`` exactly (positions
and rope deltas, with left or right padding, text-only rows included) so that a parallel model fed
with them computes what transformers computes; ``mrope_positions_packed`` gives the same per
segment of a packed (padding-free) sequence.

Qwen2.5-VL (``tokens_per_second`` given) spaces a video's temporal positions by
``tokens_per_second * second_per_grid_ts[v]`` (one value per video, in order across rows or
segments; 1 when ``second_per_grid_ts`` is None): frame ``k`` of video ``v`` takes
``int(k * interval)`` (truncated, computed in the dtype transformers' ``get_rope_index`` uses: the
product of ``arange`` with that interval). Images keep a step of 1.

The vision tower needs two more things per patch: its (h, w) coordinates for the 2D rotary
embedding, listed block-major over the ``merge x merge`` windows the patch merger concatenates,
and the boundaries of the per-frame attention segments (``vision_patch_positions`` and
``vision_cu_seqlens``, equal to ``transformers.vision_utils.get_vision_position_ids`` and
``get_vision_cu_seqlens``). Qwen2.5-VL's window attention reorders the merged patches window by
window (``vision_window_index``, equal to ``get_vision_window_index``).

``check_multimodal_inputs`` rejects inconsistent pixel values, grids and placeholder tokens with
one sentence naming the numbers. It reads only local tensors, so every rank can run it before the
first collective and fail alike instead of hanging in a collective that some rank never reaches.

How runs of vision tokens become images: like transformers, the tokens of a row (padding removed)
are split into maximal runs of one token type (0 text, 1 image, 2 video) and each image or video
run takes the next grid of its kind, in order across rows. Two images with no token between them
therefore form ONE run, which transformers pairs with the first grid only: it then fails on a
shape mismatch, or, when other runs happen to make the totals agree, silently computes positions
for the wrong grids. Here every run must hold exactly ``t*h*w/merge**2`` tokens of its grid, and
``VisionInputError`` says so otherwise. Real Qwen2-VL prompts wrap each image in
``<|vision_start|> ... <|vision_end|>``, so their runs are always separated.
"""

from __future__ import annotations

import torch

TEXT, IMAGE, VIDEO = 0, 1, 2
_KIND = {IMAGE: "image", VIDEO: "video"}


class VisionInputError(ValueError):
    """Pixel values, grids and placeholder tokens that do not describe the same images/videos."""


def token_types(input_ids: torch.Tensor, *, image_token_id: int, video_token_id: int) -> torch.Tensor:
    """``mm_token_type_ids`` as Qwen2-VL's processor builds it: 1 for image tokens, 2 for video, 0 else."""
    types = torch.zeros_like(input_ids, dtype=torch.long)
    types[input_ids == image_token_id] = IMAGE
    types[input_ids == video_token_id] = VIDEO
    return types


def merged_token_counts(grid_thw: torch.Tensor | None, spatial_merge_size: int) -> list[int]:
    """Language-model tokens of each image/video: ``t*h*w`` patches over ``merge**2`` per token."""
    if grid_thw is None:
        return []
    return [t * h * w // spatial_merge_size**2 for t, h, w in grid_thw.tolist()]


def _runs(types: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal token type as ``(type, start, end)`` (what itertools.groupby yields)."""
    runs = []
    start = 0
    for i in range(1, len(types) + 1):
        if i == len(types) or types[i] != types[start]:
            runs.append((types[start], start, i))
            start = i
    return runs


class _Grids:
    """The image and video grids as Python ints, handed out in order (shared by all rows/segments),
    and the temporal step of each (``tokens_per_second * second_per_grid_ts[v]`` for video ``v`` when
    ``tokens_per_second`` is given, else 1)."""

    def __init__(self, image_grid_thw, video_grid_thw, tokens_per_second=None, second_per_grid_ts=None):
        self.grids = {IMAGE: [] if image_grid_thw is None else image_grid_thw.tolist(),
                      VIDEO: [] if video_grid_thw is None else video_grid_thw.tolist()}
        self.used = {IMAGE: 0, VIDEO: 0}
        self.tokens_per_second, self.seconds = tokens_per_second, second_per_grid_ts
        if tokens_per_second is None and second_per_grid_ts is not None:
            raise VisionInputError("second_per_grid_ts was given but this model's temporal positions step by 1 "
                                   "(no tokens_per_second: a Qwen2.5-VL input)")

    def interval(self, kind: int, index: int):
        """Temporal step of image/video ``index`` (transformers' ``time_interval``)."""
        if kind != VIDEO or self.tokens_per_second is None:
            return 1
        return self.tokens_per_second * (1 if self.seconds is None else self.seconds[index])

    def take(self, kind: int, where: str) -> tuple[int, int, int, int]:
        index = self.used[kind]
        if index >= len(self.grids[kind]):
            raise VisionInputError(f"{where} is {_KIND[kind]} number {index} but only "
                                   f"{len(self.grids[kind])} {_KIND[kind]} grid(s) were given")
        self.used[kind] += 1
        return (index, *self.grids[kind][index])


def _sequence_positions(types: list[int], grids: _Grids, merge: int, device, where: str) -> torch.Tensor:
    """[3, n] M-RoPE positions of one unpadded sequence given its token types."""
    pieces = []
    pos = 0
    for kind, start, end in _runs(types):
        length = end - start
        if kind == TEXT:
            pieces.append((torch.arange(length, device=device) + pos).expand(3, -1))
            pos += length
            continue
        if kind not in _KIND:
            raise VisionInputError(f"mm_token_type_ids holds type {kind} at {where}, token {start}; "
                                   f"Qwen2-VL knows 0 (text), 1 (image) and 2 (video)")
        run = f"the {_KIND[kind]} tokens {start}..{end - 1} of {where}"
        index, t, h, w = grids.take(kind, run)
        gh, gw = h // merge, w // merge
        if t * gh * gw != length:
            raise VisionInputError(
                f"{run} are {length} tokens but {_KIND[kind]} {index} has grid (t, h, w) = ({t}, {h}, {w}), "
                f"i.e. {t * gh * gw} tokens after {merge}x{merge} merging (two {_KIND[kind]}s without a token "
                f"between them count as one run, as in transformers)")
        temporal = (torch.arange(t, device=device) * grids.interval(kind, index)).long()
        tt = temporal.view(t, 1, 1).expand(t, gh, gw)
        hh = torch.arange(gh, device=device).view(1, gh, 1).expand(t, gh, gw)
        ww = torch.arange(gw, device=device).view(1, 1, gw).expand(t, gh, gw)
        pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        pos += max(h, w) // merge
    if not pieces:
        return torch.zeros(3, 0, dtype=torch.long, device=device)
    return torch.cat(pieces, dim=1)


def mrope_positions(
    input_ids: torch.Tensor,
    *,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    mm_token_type_ids: torch.Tensor | None = None,
    image_token_id: int,
    video_token_id: int,
    spatial_merge_size: int,
    tokens_per_second: float | None = None,
    second_per_grid_ts=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE positions ``[3, b, s]`` (dtype of input_ids) and rope deltas ``[b, 1]`` (long) of a
    padded batch, equal to transformers' ``get_rope_index``.

    Padding slots (``attention_mask == 0``) keep position 0, as transformers leaves them. The delta
    of a row is ``max position + 1 - unpadded length``: what decoding adds to plain 1D positions of
    later tokens. ``mm_token_type_ids`` defaults to one derived from the image/video token ids.
    A row that is all padding gets zeros and delta 0 (transformers fails on it).
    ``tokens_per_second`` / ``second_per_grid_ts``: Qwen2.5-VL's temporal spacing of videos.
    """
    if input_ids.dim() != 2:
        raise VisionInputError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    if mm_token_type_ids is None:
        mm_token_type_ids = token_types(input_ids, image_token_id=image_token_id, video_token_id=video_token_id)
    if mm_token_type_ids.shape != input_ids.shape:
        raise VisionInputError(f"mm_token_type_ids has shape {tuple(mm_token_type_ids.shape)} but input_ids "
                               f"has {tuple(input_ids.shape)}")
    grids = _Grids(image_grid_thw, video_grid_thw, tokens_per_second, second_per_grid_ts)
    positions = torch.zeros(3, *input_ids.shape, dtype=input_ids.dtype, device=input_ids.device)
    deltas = []
    for row in range(input_ids.shape[0]):
        keep = (torch.ones_like(input_ids[row], dtype=torch.bool) if attention_mask is None
                else attention_mask[row].bool())
        row_pos = _sequence_positions(mm_token_type_ids[row][keep].tolist(), grids, spatial_merge_size,
                                      input_ids.device, f"row {row}")
        positions[:, row, keep] = row_pos.to(input_ids.dtype)
        deltas.append(int(row_pos.max()) + 1 - row_pos.shape[1] if row_pos.numel() else 0)
    return positions, torch.tensor(deltas, dtype=torch.long, device=input_ids.device).view(-1, 1)


def mrope_positions_packed(
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    mm_token_type_ids: torch.Tensor | None = None,
    image_token_id: int,
    video_token_id: int,
    spatial_merge_size: int,
    tokens_per_second: float | None = None,
    second_per_grid_ts=None,
) -> torch.Tensor:
    """M-RoPE positions ``[3, T]`` of sequences packed into ``input_ids`` ([T] or [1, T]).

    Segment ``i`` spans ``cu_seqlens[i]:cu_seqlens[i+1]`` and gets the positions transformers
    computes for it alone as a batch of one (restarting at 0); the grids are taken in order across
    segments, so they list the images/videos in the order they appear in the packed sequence.
    """
    if input_ids.dim() == 2 and input_ids.shape[0] == 1:
        input_ids = input_ids[0]
    if input_ids.dim() != 1:
        raise VisionInputError(f"packed input_ids must be [T] or [1, T], got shape {tuple(input_ids.shape)}")
    total = input_ids.shape[0]
    bounds = [int(b) for b in cu_seqlens.reshape(-1).tolist()]
    if not bounds or bounds[0] != 0 or bounds[-1] != total or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise VisionInputError(f"cu_seqlens {bounds} must rise from 0 to the packed length {total}")
    if mm_token_type_ids is None:
        types = token_types(input_ids, image_token_id=image_token_id, video_token_id=video_token_id)
    else:
        types = mm_token_type_ids.reshape(-1)
        if types.shape[0] != total:
            raise VisionInputError(f"mm_token_type_ids holds {types.shape[0]} tokens but input_ids holds {total}")
    grids = _Grids(image_grid_thw, video_grid_thw, tokens_per_second, second_per_grid_ts)
    pieces = [_sequence_positions(types[a:b].tolist(), grids, spatial_merge_size, input_ids.device,
                                  f"segment {i}") for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    return torch.cat(pieces, dim=1).to(input_ids.dtype)


def vision_patch_positions(grid_thw: torch.Tensor, spatial_merge_size: int) -> torch.Tensor:
    """[N, 2] (h, w) coordinates of every patch for the vision tower's 2D rotary embedding.

    Patches arrive block-major: the ``merge x merge`` patches that the merger concatenates into one
    language-model token are consecutive, windows in row-major order; a video repeats its frame's
    coordinates ``t`` times.
    """
    m = spatial_merge_size
    out = []
    for t, h, w in grid_thw.tolist():
        shape = (h // m, m, w // m, m)
        hh = torch.arange(h).view(h // m, m, 1, 1).expand(shape)
        ww = torch.arange(w).view(1, 1, w // m, m).expand(shape)
        frame = torch.stack([hh.permute(0, 2, 1, 3).reshape(-1), ww.permute(0, 2, 1, 3).reshape(-1)], dim=-1)
        out.append(frame.repeat(t, 1))
    if not out:
        return torch.zeros(0, 2, dtype=torch.long, device=grid_thw.device)
    return torch.cat(out).to(grid_thw.device)


def vision_cu_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    """int32 boundaries of the vision attention segments: one per frame (``h*w`` patches), ``t`` per entry."""
    per_frame = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return torch.nn.functional.pad(per_frame.cumsum(0, dtype=torch.int32), (1, 0))


def vision_window_index(grid_thw: torch.Tensor, spatial_merge_size: int, window_tokens: int
                        ) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's window order of the merged patches and the window boundaries in patches.

    Each frame's ``h/merge x w/merge`` merged patches are cut into windows of ``window_tokens`` per
    side (the last row/column of windows may be smaller), listed window by window, row-major inside
    a window; frames and images keep their order. Returns ``index [n_merged]`` (the merged patch at
    each new position: ``x_windowed = x.view(n_merged, merge**2, -1)[index]``) and the cumulative
    window boundaries in patches, starting at 0 (equal to transformers'
    ``vision_utils.get_vision_window_index`` with ``window_tokens = window_size // merge // patch``).
    """
    index, bounds, offset = [], [0], 0
    unit = spatial_merge_size ** 2
    n = window_tokens
    for t, h, w in grid_thw.tolist():
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        ids = torch.arange(t * gh * gw).view(t, gh, gw)
        for frame in range(t):
            for top in range(0, gh, n):
                for left in range(0, gw, n):
                    window = ids[frame, top:top + n, left:left + n].reshape(-1)
                    index.append(window + offset)
                    bounds.append(bounds[-1] + window.numel() * unit)
        offset += t * gh * gw
    if not index:
        return torch.zeros(0, dtype=torch.long, device=grid_thw.device), bounds
    return torch.cat(index).to(grid_thw.device), bounds


def _check_grid(grid: torch.Tensor, name: str, kind: str, merge: int) -> None:
    if grid.dim() != 2 or grid.shape[1] != 3 or grid.is_floating_point() or grid.is_complex():
        raise VisionInputError(f"{name} must be an integer tensor of shape [n, 3] (t, h, w per {kind}), "
                               f"got {grid.dtype} of shape {tuple(grid.shape)}")
    for index, (t, h, w) in enumerate(grid.tolist()):
        if min(t, h, w) <= 0:
            raise VisionInputError(f"{kind} {index} has grid (t, h, w) = ({t}, {h}, {w}); all must be positive")
        if h % merge or w % merge:
            raise VisionInputError(f"{kind} {index} has grid (t, h, w) = ({t}, {h}, {w}): h and w must be "
                                   f"divisible by spatial_merge_size {merge}")


def _check_kind(input_ids, pixels, grid, *, kind, pixel_name, grid_name, token_id, merge, patch_dim) -> None:
    n_tokens = int((input_ids == token_id).sum())
    if pixels is None and grid is None:
        if n_tokens:
            raise VisionInputError(f"input_ids hold {n_tokens} {kind} tokens (id {token_id}) but no "
                                   f"{pixel_name} were given")
        return
    if grid is None:
        raise VisionInputError(f"{pixel_name} were given without {grid_name}")
    if pixels is None:
        raise VisionInputError(f"{grid_name} was given without {pixel_name}")
    _check_grid(grid, grid_name, kind, merge)
    patches = sum(t * h * w for t, h, w in grid.tolist())
    if pixels.dim() != 2:
        raise VisionInputError(f"{pixel_name} must be [patches, {patch_dim}], got shape {tuple(pixels.shape)}")
    if pixels.shape[0] != patches:
        raise VisionInputError(f"{pixel_name} has {pixels.shape[0]} rows but {grid_name} needs "
                               f"sum(t*h*w) = {patches} patches")
    if pixels.shape[1] != patch_dim:
        raise VisionInputError(f"{pixel_name} has {pixels.shape[1]} columns but a patch holds in_channels * "
                               f"temporal_patch_size * patch_size**2 = {patch_dim} values")
    expected = patches // merge**2
    if n_tokens != expected:
        raise VisionInputError(f"input_ids hold {n_tokens} {kind} tokens (id {token_id}) but {grid_name} gives "
                               f"{expected} after {merge}x{merge} merging")


def check_multimodal_inputs(
    input_ids: torch.Tensor,
    *,
    pixel_values: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    pixel_values_videos: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    image_token_id: int,
    video_token_id: int,
    spatial_merge_size: int,
    patch_dim: int,
    tokens_per_second: float | None = None,
    second_per_grid_ts=None,
) -> None:
    """Raise ``VisionInputError`` unless pixels, grids and placeholder tokens agree, for images and
    videos alike (``patch_dim = in_channels * temporal_patch_size * patch_size**2``), and
    ``second_per_grid_ts`` (Qwen2.5-VL, ``tokens_per_second`` given) holds one value per video.

    Local checks only, so it is safe before any collective. Whether each run of placeholder tokens
    matches its own grid is checked by ``mrope_positions`` (also local).
    """
    common = {"merge": spatial_merge_size, "patch_dim": patch_dim}
    _check_kind(input_ids, pixel_values, image_grid_thw, kind="image", pixel_name="pixel_values",
                grid_name="image_grid_thw", token_id=image_token_id, **common)
    _check_kind(input_ids, pixel_values_videos, video_grid_thw, kind="video", pixel_name="pixel_values_videos",
                grid_name="video_grid_thw", token_id=video_token_id, **common)
    if second_per_grid_ts is None:
        return
    if tokens_per_second is None:
        raise VisionInputError("second_per_grid_ts was given but this model's temporal positions step by 1 "
                               "(no tokens_per_second: a Qwen2.5-VL input)")
    videos = 0 if video_grid_thw is None else video_grid_thw.shape[0]
    values = torch.as_tensor(second_per_grid_ts)
    if values.dim() != 1 or values.shape[0] != videos:
        raise VisionInputError(f"second_per_grid_ts has shape {tuple(values.shape)} but video_grid_thw gives "
                               f"{videos} video(s): one value per video")
