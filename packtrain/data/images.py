"""Images in continuations (Qwen3.6 vision-language packs): image references, M-RoPE coordinates, pixel loading.

A continuation's item may hold image blocks: ``<|vision_start|>`` + n image-pad tokens + ``<|vision_end|>``, where
n = T*H*W / merge^2 for the image's patch grid (T, H, W). M-RoPE gives every token three coordinates
(temporal, height, width). Text tokens have the cursor value c on all three axes and advance it by 1. An image
block's tokens take (c + t, c + h, c + w) over its merged grid (h < H/merge, w < W/merge, in row-major order),
and the cursor then advances by max(H, W) / merge — a 14 x 20 merged grid moves the next text to c + 20, not
c + 280. This is transformers' ``get_rope_index`` for one image-text sequence, computed here per continuation
with a local origin of zero and then shifted by |P| on all three axes, so a packed continuation has exactly the
coordinates it has in its standalone example. The causal mask keeps using physical token order.

P stays text-only, so continuations always start at cursor |P|.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # planning (which reads ImageRef and the positions) must not import torch
    import torch

IMAGE_PAD = "<|image_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
BUNDLED_PROCESSOR = Path(__file__).resolve().parents[1] / "assets" / "vlm"
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")  # an image processor folder's files


@dataclass(frozen=True)
class ImageRef:
    """An image of an example: where it is read from and its patch grid (T, H, W) before merging."""

    path: str
    grid_thw: tuple[int, int, int]


@dataclass(frozen=True)
class VisionSpec:
    image_token_id: int
    merge_size: int

    def tokens(self, grid_thw: Sequence[int]) -> int:
        t, h, w = grid_thw
        return t * h * w // self.merge_size ** 2


def mrope_positions(token_ids: Sequence[int], grids: Sequence[Sequence[int]], spec: VisionSpec | None,
                    start: int = 0) -> tuple[list[list[int]], int]:
    """Coordinates [[t...], [h...], [w...]] of ``token_ids`` from cursor ``start``, and the cursor after them.

    ``grids`` are the (T, H, W) patch grids of the images in order of appearance; each image's tokens are the next
    T*H*W/merge^2 image-pad tokens.
    """
    axes: list[list[int]] = [[], [], []]
    c = start
    i, n = 0, len(token_ids)
    images = iter(grids)
    while i < n:
        if spec is None or token_ids[i] != spec.image_token_id:
            for axis in axes:
                axis.append(c)
            c += 1
            i += 1
            continue
        grid = next(images, None)
        if grid is None:
            raise ValueError("more image-pad tokens than images")
        t, h, w = grid[0], grid[1] // spec.merge_size, grid[2] // spec.merge_size
        count = t * h * w
        if list(token_ids[i:i + count]) != [spec.image_token_id] * count:
            raise ValueError(f"an image with grid {tuple(grid)} needs {count} consecutive image-pad tokens")
        for tt in range(t):
            for hh in range(h):
                for ww in range(w):
                    axes[0].append(c + tt)
                    axes[1].append(c + hh)
                    axes[2].append(c + ww)
        c += max(h, w)
        i += count
    if next(images, None) is not None:
        raise ValueError("more images than image-pad token blocks")
    return axes, c


def load_image_processor(path: str | Path | None):
    """The image processor of a local processor directory (no downloads); None: the bundled tiny one."""
    from transformers import AutoImageProcessor

    path = Path(path) if path is not None else BUNDLED_PROCESSOR
    if not (path / "preprocessor_config.json").is_file():
        raise ValueError(f"data.processor: {path} has no preprocessor_config.json (a local image processor "
                         "directory is needed for examples with images)")
    return AutoImageProcessor.from_pretrained(str(path), local_files_only=True)


def open_image(path: str | Path):
    """A PIL image in RGB; OSError/ValueError for a missing or unreadable file (callers name file and line)."""
    from PIL import Image

    with Image.open(path) as im:
        return im.convert("RGB")


def process_images(paths: Sequence[str], processor) -> tuple[torch.Tensor, torch.Tensor]:
    """pixel_values [patches, C*T*P*P] and image_grid_thw [images, 3], in the order given."""
    out = processor(images=[open_image(p) for p in paths], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


class ImageLoader:
    """Loads a unit's images when its layout is built (pixel values are never kept for the whole dataset)."""

    def __init__(self, processor, spec: VisionSpec):
        self.processor = processor
        self.spec = spec

    def load(self, refs: Sequence[ImageRef]) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        pixels, grids = process_images([r.path for r in refs], self.processor)
        expected = torch.tensor([list(r.grid_thw) for r in refs], dtype=grids.dtype)
        if not torch.equal(grids, expected):
            raise ValueError(f"images changed since they were planned: grids {grids.tolist()} vs "
                             f"{expected.tolist()} ({', '.join(r.path for r in refs)})")
        return pixels, grids
