"""A toy text-to-image world FISEdit can be judged on: captioned 32x32 images of one to three coloured shapes in the
quadrants of a black background, a word-level CLIP tokenizer built from the caption vocabulary (nothing is
downloaded), the diffusers parts of a tiny Stable-Diffusion-shaped pipeline, and the edits whose true region the
generator knows.

A *layout* is a tuple of ``(cell, colour, shape)`` objects in distinct cells (0 top left, 1 top right, 2 bottom
left, 3 bottom right), sorted by cell. Each object is drawn with a fixed geometry in its cell (a 12-pixel circle,
square or upward triangle centred in the 16x16 quadrant), so a caption determines its image exactly and the true
region of every object is known. Captions name every quadrant in cell order, an empty one as "no object", so each
quadrant's words sit at the same token positions in every caption: "red circle top left and no object top right and
no object bottom left and blue square bottom right".

The model parts are chosen so that a change of one object changes the latents near that object only, as FISEdit
assumes, rather than through a shortcut across the image: the autoencoder is diffusers' AutoencoderTiny (TAESD's
architecture: convolutions, no normalisation; with AutoencoderKL's GroupNorms, whose statistics span the image,
13.5% of the latent change of a one-object edit lay more than one latent pixel away from the object, 0.09% with
the shipped one), the CLIP text encoder has no transformer layer (each output token is its word's and position's
embedding, so changing one word changes one token; with CLIP's causal layers every later token changes too), and
the UNet's transformer blocks attend to the text only (diffusers' ``only_cross_attention``: no self-attention
across the image).
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

IMAGE = 32
"""Image side in pixels (the VAE halves it: 16x16x4 latents)."""
LATENT = IMAGE // 2
CELL = IMAGE // 2
OBJECT = 12
"""Side of an object's bounding box, centred in its cell."""
COLOURS = {"red": (1.0, 0.0, 0.0), "green": (0.0, 0.8, 0.0), "blue": (0.1, 0.3, 1.0), "yellow": (1.0, 1.0, 0.0),
           "white": (1.0, 1.0, 1.0), "cyan": (0.0, 1.0, 1.0)}
SHAPES = ("circle", "square", "triangle")
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
EMPTY = "no object"
"""What a caption says of a quadrant without an object (two words, as colour + shape)."""
WORDS = (*COLOURS, *SHAPES, *EMPTY.split(), "top", "bottom", "left", "right", "and")
MAX_TOKENS = 24
"""Tokenizer length: BOS, 4 quadrants x 4 words, 3 "and", EOS (21), padded."""
HELD_OUT = 0.1
"""Share of the 2- and 3-object layouts never shown in training (the held-out captions)."""

Layout = tuple[tuple[int, str, str], ...]


def caption(layout: Layout) -> str:
    """Every quadrant in cell order: "<colour> <shape> <position>" or "no object <position>", joined by "and"."""
    named = {cell: f"{colour} {shape}" for cell, colour, shape in layout}
    return " and ".join(f"{named.get(cell, EMPTY)} {where}" for cell, where in enumerate(POSITIONS))


def _fine(cell: int, shape: str) -> np.ndarray:
    """(4 IMAGE, 4 IMAGE) bool: the object drawn at 4x supersampling."""
    ys, xs = np.mgrid[0:IMAGE * 4, 0:IMAGE * 4] / 4.0 + 0.125
    top, left = (cell // 2) * CELL + (CELL - OBJECT) / 2, (cell % 2) * CELL + (CELL - OBJECT) / 2
    v, u = (ys - top) / OBJECT, (xs - left) / OBJECT  # [0, 1) inside the bounding box
    inside = (v >= 0) & (v < 1) & (u >= 0) & (u < 1)
    if shape == "circle":
        return (v - 0.5) ** 2 + (u - 0.5) ** 2 <= 0.25
    if shape == "square":
        return inside
    if shape == "triangle":
        return inside & (np.abs(u - 0.5) <= v / 2)
    raise ValueError(f"unknown shape {shape!r}; one of {', '.join(SHAPES)}")


def _coverage(cell: int, shape: str, size: int = IMAGE) -> np.ndarray:
    """(size, size) float in [0, 1]: the share of each pixel (of an image of side `size`) the object covers."""
    scale = 4 * IMAGE // size
    return _fine(cell, shape).reshape(size, scale, size, scale).mean(axis=(1, 3))


def object_mask(cell: int, shape: str, size: int = IMAGE) -> np.ndarray:
    """(size, size) bool: the pixels at least half covered by the object, at image size or a divisor of it (the
    latent grid: LATENT)."""
    return _coverage(cell, shape, size) >= 0.5


_COVER: dict[tuple[int, str], np.ndarray] = {}


def render(layout: Layout) -> np.ndarray:
    """(IMAGE, IMAGE, 3) float32 in [0, 1]: the layout on a black background."""
    image = np.zeros((IMAGE, IMAGE, 3), dtype=np.float32)
    for cell, colour, shape in layout:
        if (cell, shape) not in _COVER:
            _COVER[(cell, shape)] = _coverage(cell, shape).astype(np.float32)
        cover = _COVER[(cell, shape)][..., None]
        image = image * (1 - cover) + cover * np.asarray(COLOURS[colour], dtype=np.float32)
    return image


def all_layouts() -> list[Layout]:
    """Every layout of one to three objects in distinct cells, in a fixed order."""
    kinds = [(c, s) for c in COLOURS for s in SHAPES]
    out: list[Layout] = []
    for count in (1, 2, 3):
        for cells in itertools.combinations(range(4), count):
            for objects in itertools.product(kinds, repeat=count):
                out.append(tuple((cell, c, s) for cell, (c, s) in zip(cells, objects, strict=True)))
    return out


@dataclass(frozen=True)
class Split:
    train: list[Layout]
    held_out: list[Layout]


def split(seed: int = 0) -> Split:
    """All one-object layouts train; of the 2- and 3-object ones a seeded HELD_OUT share is held out."""
    layouts = all_layouts()
    multi = [lay for lay in layouts if len(lay) > 1]
    rng = random.Random(seed)
    order = list(range(len(multi)))
    rng.shuffle(order)
    cut = int(len(multi) * HELD_OUT)
    held = {multi[i] for i in order[:cut]}
    return Split(train=[lay for lay in layouts if lay not in held], held_out=[multi[i] for i in sorted(order[:cut])])


@dataclass(frozen=True)
class Edit:
    """A single-object edit: `source` -> `target` differ in the colour or shape of the object in `cell`."""

    source: Layout
    target: Layout
    cell: int

    @property
    def prompts(self) -> tuple[str, str]:
        return caption(self.source), caption(self.target)

    def region(self, size: int) -> np.ndarray:
        """(size, size) bool: where the edit changes the image (union of the old and new object)."""
        old = next(o for o in self.source if o[0] == self.cell)
        new = next(o for o in self.target if o[0] == self.cell)
        return object_mask(self.cell, old[2], size) | object_mask(self.cell, new[2], size)


def held_out_edits(count: int, seed: int, split_seed: int = 0) -> list[Edit]:
    """`count` distinct single-object edits whose source and target captions are both held out from training,
    drawn with `seed` (different seeds give disjoint-by-chance sets; use `edit_sets` for guaranteed disjoint ones)."""
    held = split(split_seed).held_out
    held_set = set(held)
    rng = random.Random(seed)
    out: list[Edit] = []
    seen: set[tuple[Layout, Layout]] = set()
    for source in rng.sample(held, len(held)):
        objs = list(source)
        i = rng.randrange(len(objs))
        cell, colour, shape = objs[i]
        options = [(c, shape) for c in COLOURS if c != colour] + [(colour, s) for s in SHAPES if s != shape]
        rng.shuffle(options)
        for new_colour, new_shape in options:
            target = tuple(objs[:i] + [(cell, new_colour, new_shape)] + objs[i + 1:])
            if target in held_set and (source, target) not in seen:
                seen.add((source, target))
                out.append(Edit(source=source, target=target, cell=cell))
                break
        if len(out) == count:
            return out
    raise ValueError(f"only {len(out)} held-out edits exist for seed {seed}; ask for fewer")


def edit_sets(count: int, seed: int = 0) -> tuple[list[Edit], list[Edit]]:
    """Two disjoint sets of `count` held-out edits: one to tune the engine's settings on, one to check them on
    (no source caption in both)."""
    edits = held_out_edits(3 * count, seed)
    tune, check, used = [], [], set()
    for edit in edits:
        if edit.source in used:
            continue
        used.add(edit.source)
        (tune if len(tune) < count else check).append(edit)
        if len(check) == count:
            return tune, check
    raise ValueError(f"not enough held-out edits for two sets of {count}")


# ---- tokenizer and model parts -----------------------------------------------------------------------------------
def _bpe(pieces: list[str], merges: list[tuple[str, str]]) -> list[str]:
    """Byte-pair encoding of one word: merge the adjacent pair of lowest rank until none is in `merges`."""
    rank = {pair: i for i, pair in enumerate(merges)}
    while len(pieces) > 1:
        pairs = [(rank.get((a, b), len(rank)), i) for i, (a, b) in enumerate(itertools.pairwise(pieces))]
        best, i = min(pairs)
        if best == len(rank):
            break
        pieces = [*pieces[:i], pieces[i] + pieces[i + 1], *pieces[i + 2:]]
    return pieces


def write_tokenizer(folder: str | Path) -> object:
    """A CLIPTokenizer whose vocabulary is the caption words (one token each, with every prefix BPE passes
    through) and the single letters; saved to `folder`. Nothing is downloaded."""
    from transformers import CLIPTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = ["<|startoftext|>", "<|endoftext|>", *letters, *(f"{c}</w>" for c in letters)]
    merges: list[tuple[str, str]] = []
    for word in WORDS:  # add merges (lowest priority last) until BPE, as CLIP runs it, makes the word one token
        while len(pieces := _bpe([*word[:-1], word[-1] + "</w>"], merges)) > 1:
            merges.append((pieces[0], pieces[1]))
            if pieces[0] + pieces[1] not in vocab:
                vocab.append(pieces[0] + pieces[1])
    (folder / "vocab.json").write_text(json.dumps({tok: i for i, tok in enumerate(vocab)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(f"{a} {b}" for a, b in merges) + "\n")
    tokenizer = CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=MAX_TOKENS,
                              pad_token="<|endoftext|>")
    for word in WORDS:
        ids = tokenizer(word, add_special_tokens=False).input_ids
        if len(ids) != 1:
            raise AssertionError(f"tokenizer splits {word!r} into {ids}; the merges are wrong")
    return tokenizer


def make_vae():
    """32x32x3 <-> 16x16x4: one stride-2 level, 32 channels, one residual block per level, no normalisation."""
    from diffusers import AutoencoderTiny

    return AutoencoderTiny(in_channels=3, out_channels=3, encoder_block_out_channels=(32, 32),
                           decoder_block_out_channels=(32, 32), num_encoder_blocks=(1, 1), num_decoder_blocks=(1, 1),
                           latent_channels=4)


def make_text_encoder(vocab_size: int):
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(CLIPTextConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=0, num_attention_heads=4,
                                        max_position_embeddings=MAX_TOKENS, projection_dim=64, bos_token_id=0,
                                        eos_token_id=1, pad_token_id=1))


def make_unet():
    """16x16 -> 8x8 -> 4x4 latents; attention to the text at 8x8 and in the 4x4 mid block (a 16x16 one cost more
    than the whole rest on CPU and is not needed to place 6-pixel objects), no self-attention (see the module
    docstring)."""
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(sample_size=LATENT, in_channels=4, out_channels=4,
                                block_out_channels=(16, 32, 64), layers_per_block=1,
                                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                                cross_attention_dim=64, attention_head_dim=8, norm_num_groups=8,
                                only_cross_attention=True)


def make_scheduler():
    """Stable Diffusion's DDIM settings (the noise schedule the UNet is trained with)."""
    from diffusers import DDIMScheduler

    return DDIMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085,
                         beta_end=0.012, clip_sample=False, set_alpha_to_one=False, steps_offset=1)


# ---- judging images ----------------------------------------------------------------------------------------------
def to_array(image) -> np.ndarray:
    """PIL image or (H, W, 3) array in [0, 255] / [0, 1] -> (H, W, 3) float64 in [0, 1]."""
    array = np.asarray(image, dtype=np.float64)
    return array / 255.0 if array.max() > 1.0 + 1e-6 else array


def object_mean_colour(image, cell: int, shape: str) -> np.ndarray:
    """(3,) mean RGB in [0, 1] of the object's pixels eroded by one pixel (the anti-aliased border left out)."""
    mask = torch.from_numpy(object_mask(cell, shape))[None, None].float()
    core = (-torch.nn.functional.max_pool2d(-mask, 3, stride=1, padding=1))[0, 0].numpy() > 0.5
    return to_array(image)[core].mean(axis=0)


def object_colour_error(image, cell: int, colour: str, shape: str) -> float:
    """max over channels of |object's mean colour - the named colour| (0..1)."""
    return float(np.abs(object_mean_colour(image, cell, shape) - np.asarray(COLOURS[colour])).max())


def nearest_colour(image, cell: int, shape: str) -> str:
    """The palette colour (or "background") nearest to the object's mean colour."""
    mean = object_mean_colour(image, cell, shape)
    palette = {"background": (0.0, 0.0, 0.0), **COLOURS}
    return min(palette, key=lambda name: float(np.abs(mean - np.asarray(palette[name])).sum()))


def cell_is_empty(image, cell: int, tolerance: float = 0.15) -> bool:
    """The quadrant's mean brightness (each pixel's brightest channel: a pure red object counts fully) is within
    `tolerance` of the black background. The smallest object (a triangle) covers ~28% of its quadrant."""
    array = to_array(image)
    top, left = (cell // 2) * CELL, (cell % 2) * CELL
    return float(array[top:top + CELL, left:left + CELL].max(axis=-1).mean()) <= tolerance


def psnr(a, b, where: np.ndarray | None = None) -> float:
    """PSNR (dB, peak 1.0) of two images over the pixels `where` (all pixels when None)."""
    diff = (to_array(a) - to_array(b)) ** 2
    mse = float(diff[where].mean() if where is not None else diff.mean())
    return float("inf") if mse == 0 else 10.0 * float(np.log10(1.0 / mse))


def mask_iou(mask: np.ndarray, region: np.ndarray) -> float:
    union = np.logical_or(mask, region).sum()
    return float(np.logical_and(mask, region).sum() / union) if union else 1.0
