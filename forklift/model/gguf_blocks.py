"""Decode a GGUF matrix's raw blocks into the forms the quantized kernels multiply.

Block layouts are ggml's (ggml-common.h; gguf-py's `gguf/quants.py` reads the same bytes):
- Q4_0: fp16 d, 16 bytes of nibbles; w = d * (q - 8).
- Q4_1: fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m.
- Q5_0: fp16 d, 32 high bits (little-endian uint32), 16 bytes of nibbles; w = d * (q - 16).
- Q8_0: fp16 d, 32 int8; w = d * q.
- Q4_K: super-blocks of 256: fp16 d, fp16 dmin, 12 bytes packing 6-bit (sc, m) for eight
  sub-blocks of 32, 128 bytes of nibbles; w = (d * sc) * q - dmin * m.
- Q5_1, Q5_K, Q6_K: 5- and 6-bit codes with offsets or per-16 scales; no exact form here.
Nibbles run low first: a Q4_0 / Q4_1 / Q5_0 block's 32 values are the low nibbles of its 16
bytes, then their high nibbles; each 32 bytes of Q4_K give two sub-blocks the same way.

`int4_groups` gives Q4_0, Q4_1 and Q4_K as `Int4Groups` exactly. `int8_blocks` gives Q8_0,
Q5_0 and Q4_0 as `Int8Blocks` exactly and rounds every other supported type to it (see
`round_to_int8_blocks` for the bound).
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from forklift.model.layers.quantized import GROUP_SIZE, Int4Groups, Int8Blocks

BlockType = gguf.GGMLQuantizationType
# Block types each decoder reads; the names are `GGMLQuantizationType` names.
INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})
EXACT_INT8_TYPES = frozenset({"Q8_0", "Q5_0", "Q4_0"})
INT8_TYPES = EXACT_INT8_TYPES | INT4_TYPES | {"Q5_1", "Q5_K", "Q6_K"}


def int4_groups(data: np.ndarray, qtype: BlockType, shape: tuple[int, int]) -> Int4Groups:
    """The exact Int4Groups of a [N, K] matrix stored as Q4_0, Q4_1 or Q4_K blocks.

    Q4_1 is scale d and zero m + 8d; Q4_K's sub-block j is scale d * sc_j and zero
    8 * d * sc_j - dmin * m_j. Dequantized in fp32 these equal gguf's own values bit for bit
    whenever the zero is exact in fp32, i.e. unless d and dmin (or Q4_1's d and m) lie many
    binades apart: every product involved has at most 21 significant bits."""
    blocks = _blocks(data, qtype, shape)
    n, k = shape
    if qtype in (BlockType.Q4_0, BlockType.Q4_1):
        scales = _half(blocks, 0)
        if qtype == BlockType.Q4_1:
            zeros = _half(blocks, 2) + 8 * scales
        else:
            zeros = np.zeros_like(scales)
        codes = _nibbles(blocks[..., -GROUP_SIZE // 2 :])
    elif qtype == BlockType.Q4_K:
        d, dmin = _half(blocks, 0)[..., None], _half(blocks, 2)[..., None]
        sub_scales, sub_mins = _k_scales_and_mins(blocks[..., 4:16])
        scales = d * sub_scales.astype(np.float32)  # [N, K / 256, 8]
        zeros = 8 * scales - dmin * sub_mins.astype(np.float32)
        codes = _nibbles(blocks[..., 16:].reshape(n, k // 256, 4, GROUP_SIZE))
    else:
        raise ValueError(f"{qtype.name} blocks are not 4-bit groups")
    return Int4Groups(
        torch.from_numpy(np.ascontiguousarray(codes.reshape(n, k))),
        torch.from_numpy(np.ascontiguousarray(scales.reshape(n, k // GROUP_SIZE))),
        torch.from_numpy(np.ascontiguousarray(zeros.reshape(n, k // GROUP_SIZE))),
    )


def int8_blocks(data: np.ndarray, qtype: BlockType, shape: tuple[int, int]) -> Int8Blocks:
    """The Int8Blocks of a [N, K] matrix: exact for Q8_0, Q5_0 and Q4_0, otherwise
    `round_to_int8_blocks` of gguf's exact dequantization."""
    n, k = shape
    if qtype.name not in EXACT_INT8_TYPES:
        if qtype.name not in INT8_TYPES:
            raise ValueError(f"{qtype.name} blocks have no int8 form here")
        return round_to_int8_blocks(gguf.quants.dequantize(_raw(data), qtype).reshape(n, k))
    blocks = _blocks(data, qtype, shape)
    if qtype == BlockType.Q8_0:
        codes = blocks[..., 2:].copy().view(np.int8)
    elif qtype == BlockType.Q5_0:
        high = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")  # bit j: value j
        codes = (_nibbles(blocks[..., 6:]) | (high << 4)).view(np.int8) - np.int8(16)
    else:  # Q4_0
        codes = _nibbles(blocks[..., 2:]).view(np.int8) - np.int8(8)
    return Int8Blocks(
        torch.from_numpy(np.ascontiguousarray(codes.reshape(n, k))),
        torch.from_numpy(_half(blocks, 0)),
    )


# Types `dequantize` reads itself; gguf's reader handles the rest.
DIRECT_DENSE_TYPES = frozenset({"Q4_0", "Q4_1", "Q8_0"})


def dequantize(data: np.ndarray, qtype: BlockType, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's float32 values, bit for bit gguf's (`gguf.quants.dequantize`): Q4_0, Q4_1
    and Q8_0 with gguf's own arithmetic over the whole tensor at once (gguf's reader works
    through row chunks, seconds of start-up for the default model), other types by gguf."""
    if qtype.name not in DIRECT_DENSE_TYPES:
        return gguf.quants.dequantize(data, qtype).reshape(shape)
    n = int(np.prod(shape[:-1]))
    blocks = _blocks(data, qtype, (n, shape[-1]))
    d = _half(blocks, 0)[..., None]
    if qtype == BlockType.Q8_0:
        values = blocks[..., 2:].copy().view(np.int8).astype(np.float32) * d
    elif qtype == BlockType.Q4_1:
        values = (d * _nibbles(blocks[..., 4:]).astype(np.float32)) + _half(blocks, 2)[..., None]
    else:  # Q4_0
        values = d * (_nibbles(blocks[..., 2:]).astype(np.int8) - np.int8(8)).astype(np.float32)
    return values.reshape(shape)


def round_to_int8_blocks(weight: np.ndarray) -> Int8Blocks:
    """Symmetric round-to-nearest per 32 inputs of a [N, K] float32 weight, with each block's
    scale its max |w| / 127 rounded up to an fp16 value (so the native kernel's fp16 scales
    hold it exactly, and no code needs clamping).

    Bound: |w - code * scale| <= scale / 2 * (1 + 1e-5) (the 1e-5: fp32 rounding of
    w / scale), and scale <= (1 + 2^-10) * amax / 127 + 2^-24 (the first term for normal
    fp16 scales, the second for subnormal ones), amax being the block's largest |w|. So
    every value is within (amax / 254 * (1 + 2^-10) + 2^-25) * (1 + 1e-5) of its exact
    value: about 0.4% of its block's largest."""
    n, k = weight.shape
    if k % GROUP_SIZE:
        raise ValueError(f"int8 blocks need input sizes divisible by {GROUP_SIZE}, got {k}")
    grouped = weight.astype(np.float32, copy=False).reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    scales = _fp16_at_least(np.abs(grouped).max(axis=-1) / np.float32(127))
    safe = np.where(scales > 0, scales, np.float32(1))
    codes = np.rint(grouped / safe[..., None]).clip(-127, 127).astype(np.int8)
    return Int8Blocks(torch.from_numpy(codes.reshape(n, k)), torch.from_numpy(scales), False)


def _raw(data: np.ndarray) -> np.ndarray:
    """A tensor's bytes as one uint8 row (reader arrays come typed and shaped variously)."""
    return np.asarray(data).view(np.uint8).reshape(-1)


def _blocks(data: np.ndarray, qtype: BlockType, shape: tuple[int, int]) -> np.ndarray:
    """[N, K / block size, block bytes] uint8 view of a [N, K] matrix's blocks."""
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n, k = shape
    if k % block_size:
        raise ValueError(f"{qtype.name} rows need multiples of {block_size} inputs, got {k}")
    raw = _raw(data)
    if raw.size != n * k // block_size * block_bytes:
        raise ValueError(f"{raw.size} bytes do not hold a {n}x{k} {qtype.name} matrix")
    return raw.reshape(n, k // block_size, block_bytes)


def _half(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 at `offset` of every block, as float32."""
    return blocks[..., offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., B] bytes -> [..., 2B] codes: the low nibbles, then the high ones."""
    return np.concatenate([packed & 15, packed >> 4], axis=-1)


def _k_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's / Q5_K's 12 bytes -> 6-bit (sc, m) for eight sub-blocks, each [..., 8] uint8.
    Bytes 0-3 hold sc 0-3 in their low six bits, 4-7 hold m 0-3 likewise; sub-blocks 4-7
    take their low four bits from bytes 8-11 (sc low nibble, m high nibble) and their top
    two from the top two bits of bytes 0-3 (sc) and 4-7 (m)."""
    low, high, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([low & 63, (extra & 15) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([high & 63, (extra >> 4) | ((high >> 6) << 4)], axis=-1)
    return scales, mins


def _fp16_at_least(values: np.ndarray) -> np.ndarray:
    """The least fp16 value >= each float32 value, as float32."""
    with np.errstate(over="ignore"):  # overflows become inf, refused below
        half = values.astype(np.float16)
        short = half.astype(np.float32) < values
        half = np.where(short, np.nextafter(half, np.float16(np.inf)), half)
    if not np.isfinite(half).all():
        raise ValueError("a weight block exceeds the fp16 range of int8 block scales")
    return half.astype(np.float32)
