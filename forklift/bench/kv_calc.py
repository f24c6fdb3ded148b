"""KV-cache arithmetic: how many bytes a context needs, and what a memory budget buys.

`forklift kv-calc` prints both with the numbers filled in, for a model's config or for an
explicit shape.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from forklift.config import KV_CACHE_DTYPES, PLAIN_KV_CACHE_DTYPES
from forklift.core.kv_cache_manager import blocks_for_tokens, blocks_per_sequence
from forklift.core.state_checkpoints import CHECKPOINT_BUDGET_SHARE

DTYPE_BYTES = (("bfloat16", 2), ("float16", 2), ("float32", 4))
# A coded cache row's float32 scale after its one-byte codes (model/kv_cache_dtype.py).
CODE_SCALE_BYTES = 4


@dataclass(frozen=True)
class KVShape:
    """The three numbers of a model that set its KV bytes per token (`num_layers` counts
    only full-attention layers: a hybrid model's linear layers keep no KV)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class KVRow:
    """How the cache stores one row (a token's K or V for one KV head): `dtype` values (or
    kv_cache_dtype's, bfloat16 or float32), or with a coded kv_cache_dtype (int8, fp8) one
    byte a value and a float32 scale."""

    dtype: str
    kv_cache_dtype: str = "auto"

    @property
    def coded(self) -> bool:
        return self.kv_cache_dtype not in ("auto", *PLAIN_KV_CACHE_DTYPES)

    @property
    def value_dtype(self) -> str:
        return self.kv_cache_dtype if self.kv_cache_dtype in PLAIN_KV_CACHE_DTYPES else self.dtype

    def bytes(self, head_dim: int) -> int:
        if self.coded:
            return head_dim + CODE_SCALE_BYTES
        return head_dim * dtype_bytes(self.value_dtype)

    def formula(self, head_dim: int, num_tokens: int) -> str:
        """head dim x tokens x bytes per element, the scale's bytes added to a coded row."""
        if self.coded:
            return (
                f"({head_dim} + {CODE_SCALE_BYTES}) x {num_tokens} x 1 ({self.kv_cache_dtype}, "
                "scale float32)"
            )
        size = dtype_bytes(self.value_dtype)
        return f"{head_dim} x {num_tokens} x {size} ({self.value_dtype})"


@dataclass(frozen=True)
class WindowedGroups:
    """A model whose sliding-window layers have KV groups of their own (model/kv_layout.py):
    one window per group (None: a full-attention group) of `layers_per_group` layers each."""

    layers_per_group: int
    windows: tuple[int | None, ...]

    def blocks_per_sequence(self, num_tokens: int, block_size: int, chunk: int) -> int:
        return blocks_per_sequence(num_tokens, self.windows, block_size, chunk)

    def block_bytes(self, shape: KVShape, row: KVRow, block_size: int) -> int:
        per_token = 2 * self.layers_per_group * shape.num_kv_heads * row.bytes(shape.head_dim)
        return per_token * block_size

    def lines(self, shape: KVShape, num_tokens: int, row: KVRow, block_size: int,
              chunk: int) -> list[str]:  # fmt: skip
        block = self.block_bytes(shape, row, block_size)
        full = num_tokens * kv_bytes_per_token(shape, row)
        window = next(w for w in self.windows if w is not None)
        full_groups = self.windows.count(None)
        lines = [
            f"sliding-window layers keep their last {window} positions: KV groups of "
            f"{self.layers_per_group} layers ({full_groups} full, "
            f"{len(self.windows) - full_groups} windowed), blocks of {block_size} tokens x "
            f"{self.layers_per_group} layers = {block:,} bytes"
        ]
        for label, step in (("decoding", 1), (f"prefilling {chunk}-token chunks", chunk)):
            blocks = self.blocks_per_sequence(num_tokens, block_size, step)
            held = blocks * block
            lines.append(
                f"  one {num_tokens}-token sequence, {label}: {blocks:,} blocks = "
                f"{format_bytes(held)} ({held / full:.3f} of every layer's full context)"
            )
        return lines


@dataclass(frozen=True)
class LinearStateShape:
    """A hybrid model's linear layers: a fixed-size state per sequence, whatever its length."""

    num_layers: int
    conv_elements: int  # per layer, in the model's dtype
    recurrent_elements: int  # per layer, float32

    def bytes_per_sequence(self, element: int) -> int:
        return self.num_layers * (self.conv_elements * element + self.recurrent_elements * 4)

    def lines(self, dtype: str) -> list[str]:
        element = dtype_bytes(dtype)
        conv = self.num_layers * self.conv_elements * element
        recurrent = self.num_layers * self.recurrent_elements * 4
        return [
            f"linear-attention state per sequence ({self.num_layers} linear layers, any length):",
            f"  conv {self.num_layers} x {self.conv_elements} x {element} ({dtype}) = {conv:,} "
            f"bytes; recurrent {self.num_layers} x {self.recurrent_elements} x 4 (float32) = "
            f"{recurrent:,} bytes",
            f"  = {format_bytes(conv + recurrent)}",
        ]


@dataclass(frozen=True)
class BudgetBreakdown:
    """What `budget_bytes` of KV cache holds, in blocks, tokens and whole requests."""

    budget_bytes: int
    bytes_per_token: int
    block_size: int
    request_len: int
    bytes_per_block: int
    num_blocks: int
    num_tokens: int
    blocks_per_request: int
    num_requests: int


def require_positive(name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def dtype_bytes(dtype: str) -> int:
    for name, size in DTYPE_BYTES:
        if name == dtype:
            return size
    names = ", ".join(name for name, _ in DTYPE_BYTES)
    raise ValueError(f"dtype must be one of {names}; got {dtype!r}")


def kv_cache_bytes(
    num_layers: int, num_kv_heads: int, head_dim: int, num_tokens: int, bytes_per_element: int
) -> int:
    """K and V (the 2), for every layer and KV head, for every token of the context."""
    for name, value in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("num_tokens", num_tokens),
        ("bytes_per_element", bytes_per_element),
    ):
        require_positive(name, value)
    return 2 * num_layers * num_kv_heads * head_dim * num_tokens * bytes_per_element


def budget_breakdown(
    budget_bytes: int, bytes_per_token: int, block_size: int, request_len: int
) -> BudgetBreakdown:
    """Blocks, tokens and requests of `request_len` tokens that fit in `budget_bytes`.

    Pure arithmetic: forklift's engine keeps one more block aside (the null block).
    """
    for name, value in (
        ("budget_bytes", budget_bytes),
        ("bytes_per_token", bytes_per_token),
        ("block_size", block_size),
        ("request_len", request_len),
    ):
        require_positive(name, value)
    bytes_per_block = bytes_per_token * block_size
    num_blocks = budget_bytes // bytes_per_block
    per_request = blocks_for_tokens(request_len, block_size)
    return BudgetBreakdown(
        budget_bytes=budget_bytes,
        bytes_per_token=bytes_per_token,
        block_size=block_size,
        request_len=request_len,
        bytes_per_block=bytes_per_block,
        num_blocks=num_blocks,
        num_tokens=num_blocks * block_size,
        blocks_per_request=per_request,
        num_requests=num_blocks // per_request,
    )


def kv_bytes_per_token(shape: KVShape, row: KVRow) -> int:
    return 2 * shape.num_layers * shape.num_kv_heads * row.bytes(shape.head_dim)


def format_bytes(num_bytes: float) -> str:
    return f"{num_bytes:,.0f} bytes = {num_bytes / 2**20:,.2f} MiB = {num_bytes / 2**30:,.2f} GiB"


def formula_lines(shape: KVShape, num_tokens: int, row: KVRow) -> list[str]:
    require_positive("num_tokens", num_tokens)
    per_token = kv_bytes_per_token(shape, row)
    total = per_token * num_tokens
    return [
        "KV cache = 2 (K and V) x layers x KV heads x head dim x tokens x bytes per element",
        f"         = 2 x {shape.num_layers} x {shape.num_kv_heads} x "
        f"{row.formula(shape.head_dim, num_tokens)}",
        f"         = {total} bytes",
        f"         = {format_bytes(total)}",
        f"per token: {per_token:,} bytes",
    ]


def breakdown_lines(b: BudgetBreakdown) -> list[str]:
    return [
        f"budget: {format_bytes(b.budget_bytes)}",
        f"  blocks of {b.block_size} tokens: {b.bytes_per_block:,} bytes each -> "
        f"{b.num_blocks:,} blocks",
        f"  tokens: {b.num_tokens:,}",
        f"  requests of {b.request_len:,} tokens ({b.blocks_per_request:,} blocks each): "
        f"{b.num_requests:,} at once",
        "  (forklift's engine keeps one block aside as the null block)",
    ]


# ---- command line -----------------------------------------------------------------------


def add_kv_calc_parser(sub: argparse._SubParsersAction) -> None:
    calc = sub.add_parser("kv-calc", help="KV-cache bytes for a context, and what a budget buys")
    calc.add_argument("--model", default=None, help="HF model dir or GGUF file (default model)")
    calc.add_argument("--layers", type=int, default=None, help="overrides the model's")
    calc.add_argument("--kv-heads", type=int, default=None, help="overrides the model's")
    calc.add_argument("--head-dim", type=int, default=None, help="overrides the model's")
    calc.add_argument("--tokens", type=int, default=8192, help="context length")
    calc.add_argument("--dtype", default="bfloat16", choices=[n for n, _ in DTYPE_BYTES])
    calc.add_argument(
        "--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
        help="the engine's kv_cache_dtype: auto (rows in --dtype), bfloat16, float32, int8 "
        "or fp8",
    )  # fmt: skip
    budget = calc.add_mutually_exclusive_group()
    budget.add_argument("--budget-gib", type=float, default=None)
    budget.add_argument("--budget-bytes", type=int, default=None)
    calc.add_argument("--block-size", type=int, default=16)
    calc.add_argument("--request-len", type=int, default=None, help="default: --tokens")
    calc.add_argument(
        "--chunk", type=int, default=2048,
        help="tokens a prefill step computes (the engine's max_num_batched_tokens): "
        "sliding-window layers hold them beside their window",
    )  # fmt: skip
    calc.set_defaults(func=cmd_kv_calc)


def cmd_kv_calc(args: argparse.Namespace) -> int:
    _check_args(args)
    shape, state, windowed, source = _shape_from_args(args)
    print(source)
    row = KVRow(args.dtype, args.kv_cache_dtype)
    for line in formula_lines(shape, args.tokens, row):
        print(line)
    if windowed is not None:
        for line in windowed.lines(shape, args.tokens, row, args.block_size, args.chunk):
            print(line)
    if state is not None:
        for line in state.lines(args.dtype):
            print(line)
    budget = _budget_bytes(args)
    if budget is not None:
        per_token = kv_bytes_per_token(shape, row)
        request_len = args.request_len if args.request_len is not None else args.tokens
        breakdown = budget_breakdown(budget, per_token, args.block_size, request_len)
        for line in breakdown_lines(breakdown):
            print(line)
        if windowed is not None:
            held = windowed.blocks_per_sequence(request_len, args.block_size, 1)
            per_block = windowed.block_bytes(shape, row, args.block_size)
            print(
                f"  with the windowed groups: {budget // (held * per_block):,} decoding "
                f"requests at once ({held:,} blocks of {per_block:,} bytes each)"
            )
        if state is not None:
            per_request = breakdown.blocks_per_request * breakdown.bytes_per_block
            per_request += state.bytes_per_sequence(dtype_bytes(args.dtype))
            print(
                f"  with each request's linear-layer state: {budget // per_request:,} "
                f"requests at once"
            )
            state_bytes = state.bytes_per_sequence(dtype_bytes(args.dtype))
            for line in checkpoint_lines(state_bytes, per_token, budget, per_request):
                print(line)
    return 0


def checkpoint_lines(
    state_bytes: int, bytes_per_token: int, budget: int, per_request: int
) -> list[str]:
    """What prefix caching's state checkpoints (one state each) cost a hybrid model: at most
    1/CHECKPOINT_BUDGET_SHARE of the budget, 1.5 per request that fits."""
    count = min(budget // CHECKPOINT_BUDGET_SHARE // state_bytes, 3 * (budget // per_request) // 2)
    lines = [
        f"  prefix caching: up to {count:,} linear-layer state checkpoints, leaving room "
        f"for {(budget - count * state_bytes) // per_request:,} requests at once"
    ]
    if bytes_per_token:
        lines.append(
            f"  each checkpoint holds as many bytes as {state_bytes / bytes_per_token:,.0f} "
            "tokens of K/V"
        )
    return lines


def _check_args(args: argparse.Namespace) -> None:
    # Name the flag the user typed, not the parameter it feeds.
    for flag, value in (
        ("--layers", args.layers),
        ("--kv-heads", args.kv_heads),
        ("--head-dim", args.head_dim),
        ("--tokens", args.tokens),
        ("--budget-gib", args.budget_gib),
        ("--budget-bytes", args.budget_bytes),
        ("--block-size", args.block_size),
        ("--request-len", args.request_len),
        ("--chunk", args.chunk),
    ):
        if value is not None:
            require_positive(flag, value)


def _shape_from_args(
    args: argparse.Namespace,
) -> tuple[KVShape, LinearStateShape | None, WindowedGroups | None, str]:
    explicit = (args.layers, args.kv_heads, args.head_dim)
    if None not in explicit:
        return KVShape(*explicit), None, None, "shape: given on the command line"
    # Imported here: reading a model pulls in its loaders, which explicit shapes never need.
    from forklift.checkpoint.source import resolve_model
    from forklift.model.kv_layout import kv_layout
    from forklift.model.model_source import load_model_config

    source = resolve_model(args.model)
    config = load_model_config(source)
    shape = KVShape(
        args.layers or len(config.attention_layers),
        args.kv_heads or config.num_kv_heads,
        args.head_dim or config.head_dim,
    )
    linear = config.linear_attention
    state = None
    if linear is not None and config.linear_layers:
        state = LinearStateShape(
            len(config.linear_layers),
            linear.conv_state_elements(),
            linear.recurrent_state_elements(),
        )
    layout = kv_layout(config)
    windowed = None
    windows = layout.windows
    if args.layers is None and None in windows and any(w is not None for w in windows):
        windowed = WindowedGroups(layout.layers_per_block, windows)
    return shape, state, windowed, f"model: {source.path.name} ({config.architecture})"


def _budget_bytes(args: argparse.Namespace) -> int | None:
    if args.budget_bytes is not None:
        return args.budget_bytes
    if args.budget_gib is not None:
        return int(args.budget_gib * 2**30)
    return None
