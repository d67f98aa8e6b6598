"""What each model is, without its arithmetic: the sequence model's and the click DLRM's configs, the optimisers'
config, and a sub-batch's lookups as numpy indices.

The config's checks, the pre-flight, the data layer, the planner and the stores read these without importing
PyTorch; the arithmetic over them is in shardflow.model.sequence, shardflow.model.dlrm and shardflow.model.optim,
and shardflow.model.forward hands a sub-batch to its model. So `shardflow run` refuses bad input and answers a
night with nothing new without PyTorch (1.7 s of a 3.5 s answer on the 2-core machine), and a run imports it while
the embedded API starts (cli/launch.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

from shardflow.errors import InputError
from shardflow.model import sizes
from shardflow.model.sizes import attention_shapes
from shardflow.planner.sharding_plan import ROW_OPTIMIZERS

ENCODERS = ("mean", "self-attention")
LOSSES = ("bce", "sampled-softmax", "gbce")


@dataclass(frozen=True)
class ModelConfig:
    """The sequence model (shardflow.model.sequence)."""

    dim: int = sizes.DIM
    mlp: tuple[int, ...] = sizes.MLP
    history: int = sizes.HISTORY
    negatives: int = sizes.NEGATIVES
    features: tuple[str, ...] = ()  # categorical feature tables, in input order
    seed: int = 0
    encoder: str = sizes.ENCODER  # one of ENCODERS
    blocks: int = sizes.BLOCKS  # self-attention: blocks
    heads: int = sizes.HEADS  # self-attention: heads per block (dim divisible by it)
    dropout: float = sizes.DROPOUT  # self-attention: the rate of every dropout while training
    item_dropout: float = sizes.ITEM_DROPOUT  # the dropout rate on the item rows a step reads, a mask a (step, row)
    loss: str = sizes.LOSS  # one of LOSSES
    gbce_t: float = sizes.GBCE_T  # loss gbce: the calibration t

    kind = "sequence"

    def __post_init__(self) -> None:
        for name in ("dim", "history"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"model {name} = {v!r}; accepted: an integer >= 1")
        if isinstance(self.negatives, bool) or not isinstance(self.negatives, int) or self.negatives < 1:
            raise InputError(f"model negatives = {self.negatives!r}; accepted: an integer >= 1")
        if any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in self.mlp):
            raise InputError(f"model mlp widths = {list(self.mlp)}; accepted: integers >= 1")
        if self.loss not in LOSSES:
            raise InputError(f"model loss = {self.loss!r}; accepted: {', '.join(LOSSES)}")
        if isinstance(self.gbce_t, bool) or not isinstance(self.gbce_t, (int, float)) or not 0.0 <= self.gbce_t <= 1.0:
            raise InputError(f"model gbce_t = {self.gbce_t!r}; accepted: a number in [0, 1]")
        if self.encoder not in ENCODERS:
            raise InputError(f"model encoder = {self.encoder!r}; accepted: {', '.join(ENCODERS)}")
        for name in ("blocks", "heads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"model {name} = {v!r}; accepted: an integer >= 1")
        if self.attention and self.dim % self.heads:
            raise InputError(f"model heads = {self.heads} for dim {self.dim}; accepted: a divisor of dim")
        for name in ("dropout", "item_dropout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < 1.0:
                raise InputError(f"model {name} = {v!r}; accepted: a rate in [0, 1)")

    @property
    def attention(self) -> bool:
        return self.encoder == "self-attention"

    def step_bytes(self, examples: int) -> int:
        """A bound on a trainer's working set in a step of `examples` (shardflow.model.sizes.step_bytes)."""
        return sizes.step_bytes(examples, self.dim, self.history, self.negatives,
                                self.blocks if self.attention else 0, self.heads)

    @property
    def candidates(self) -> int:
        """Logits per example: the positive and the negatives."""
        return 1 + self.negatives

    @property
    def loss_terms(self) -> int:
        """Loss terms per example: a mean over the batch's terms is the loss sub-batches' gradients add up to."""
        return 1 if self.loss == "sampled-softmax" else self.candidates

    @property
    def input_width(self) -> int:
        return (3 + len(self.features)) * self.dim

    @property
    def layers(self) -> list[tuple[int, int]]:
        widths = [self.input_width, *self.mlp, 1]
        return list(pairwise(widths))

    def dense_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every dense parameter's shape, by name: weights [in, out], biases [out]."""
        if self.attention:
            return attention_shapes(self.dim, self.history, self.blocks)
        out: dict[str, tuple[int, ...]] = {}
        for i, (fan_in, fan_out) in enumerate(self.layers):
            out[f"mlp.{i}.weight"], out[f"mlp.{i}.bias"] = (fan_in, fan_out), (fan_out,)
        return out

    def init_dense(self) -> dict[str, np.ndarray]:
        """Glorot-uniform weights, zero biases, layer norms at one and zero, from the config's seed."""
        return glorot(self.dense_shapes(), np.random.default_rng(self.seed))


def glorot(shapes: dict[str, tuple[int, ...]], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Glorot-uniform matrices (the attention's positions too), zero biases, layer norms at one and zero."""
    params = {}
    for name, shape in shapes.items():
        if len(shape) == 2:
            a = np.sqrt(6.0 / (shape[0] + shape[1]))
            params[name] = rng.uniform(-a, a, size=shape).astype(np.float32)
        elif name.endswith(("norm.weight", "norm1.weight", "norm2.weight")):
            params[name] = np.ones(shape, dtype=np.float32)
        else:
            params[name] = np.zeros(shape, dtype=np.float32)
    return params


@dataclass
class BatchIndex:
    """Where each lookup of a sub-batch finds its row among the rows the trainer holds."""

    item: str  # the item table
    history: np.ndarray  # [E, L] row index into the item rows, -1 where padded
    candidates: np.ndarray  # [E, 1 + K] row index into the item rows; column 0 is the positive
    features: dict[str, np.ndarray] = field(default_factory=dict)  # name -> [E] row index
    keys: np.ndarray | None = None  # uint64 [E]: training examples' dropout keys (None: evaluation)
    catalog: int = 0  # the item table's rows, over which the negatives are drawn (loss gbce's sampling rate)
    item_ids: np.ndarray | None = None  # the ids of the item rows history and candidates index (None: row = id)
    step_key: int | None = None  # a training step's key, the same in each of its sub-batches (item dropout's)


@dataclass(frozen=True)
class ClickConfig:
    """The click-log DLRM (shardflow.model.dlrm)."""

    dim: int = 16
    bottom: tuple[int, ...] = sizes.BOTTOM_MLP  # hidden widths of the bottom MLP; its output is `dim` wide
    mlp: tuple[int, ...] = sizes.MLP  # hidden widths of the top MLP
    features: tuple[str, ...] = ()  # categorical tables, in input order
    numeric: tuple[str, ...] = ()  # numeric columns, in input order
    seed: int = 0

    kind = "click"
    candidates = 1  # logits per example (a click label each)
    loss_terms = 1  # its binary cross-entropy

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise InputError(f"model dim = {self.dim!r}; accepted: an integer >= 1")
        for name in ("bottom", "mlp"):
            widths = getattr(self, name)
            if any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths):
                raise InputError(f"model {name} widths = {list(widths)}; accepted: integers >= 1")
        if not self.features:
            raise InputError("a click model without categorical tables; accepted: at least one table")

    @property
    def vectors(self) -> int:
        return len(self.features) + (1 if self.numeric else 0)

    @property
    def bottom_layers(self) -> list[tuple[int, int]]:
        if not self.numeric:
            return []
        widths = [len(self.numeric), *self.bottom, self.dim]
        return list(pairwise(widths))

    @property
    def top_layers(self) -> list[tuple[int, int]]:
        n = self.vectors
        widths = [(self.dim if self.numeric else 0) + n * (n - 1) // 2, *self.mlp, 1]
        return list(pairwise(widths))

    def dense_shapes(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for part, layers in (("bottom", self.bottom_layers), ("top", self.top_layers)):
            for i, (fan_in, fan_out) in enumerate(layers):
                out[f"{part}.{i}.weight"], out[f"{part}.{i}.bias"] = (fan_in, fan_out), (fan_out,)
        return out

    def init_dense(self) -> dict[str, np.ndarray]:
        """Glorot-uniform weights, zero biases, from the config's seed."""
        return glorot(self.dense_shapes(), np.random.default_rng(self.seed))


def numeric_input(values: np.ndarray) -> np.ndarray:
    """The bottom MLP's input from raw numeric columns: log(1 + max(x, 0)), 0 where missing."""
    x = np.nan_to_num(np.asarray(values, dtype=np.float32), nan=0.0)
    return np.log1p(np.maximum(x, 0.0)).astype(np.float32)


FUSED = "(fused)"  # the rows key of tables fused into one (shardflow.training.fusion); no table name has "("


@dataclass
class ClickIndex:
    """Where each lookup of a sub-batch finds its row, with the examples' numeric inputs and labels.

    With tables fused (shardflow.training.fusion), `fused` holds the positions of the fused one-id tables' rows
    in rows[FUSED], one column per table, and `order` puts the vectors back in the model's order; `features`
    holds the other tables, a fused one's positions also in rows[FUSED]."""

    # table -> int64 [E] row index, or [E, width] for a table of token sequences (-1 padding)
    features: dict[str, np.ndarray]
    numeric: np.ndarray  # float32 [E, numeric columns], already numeric_input
    labels: np.ndarray  # float32 [E]
    fused: np.ndarray | None = None  # int64 [E, fused one-id tables]
    order: np.ndarray | None = None  # int64 [n]: the model's vector k is the fused stack's order[k]-th; [] if same


DENSE_OPTIMIZERS = ("adam", "adagrad")
# Each row optimizer's default rate. Adam's: of 1e-3, 2e-3 and 5e-3 tried on Amazon Games (self-attention, one
# exploratory single-process run each on a lent H200), 1e-3 stayed near the popularity ranking (HR@10 0.48) for
# 15 epochs, 2e-3 reached HR@10 0.732 by epoch 37 and 5e-3 0.730 by 31; the engine's figures: docs/benchmarks.md.
ROW_LR = {"adagrad": 0.05, "adam": 2e-3}
# The state torch.optim keeps per parameter, by the name an export stores it under (shardflow.model.optim).
DENSE_SLOTS = {"adam": {"m": "exp_avg", "v": "exp_avg_sq"}, "adagrad": {"sum": "sum"}}


@dataclass(frozen=True)
class OptimizerConfig:
    """The rows' and the dense parameters' optimisers (shardflow.model.optim)."""

    row_lr: float | None = None  # None: the row optimizer's default (ROW_LR)
    rows: str = "adagrad"
    dense: str = "adam"
    dense_lr: float = 1e-3
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999

    @property
    def row_rate(self) -> float:
        """The rows' rate: row_lr, or the row optimizer's default."""
        return ROW_LR[self.rows] if self.row_lr is None else self.row_lr

    def __post_init__(self) -> None:
        if self.rows not in ROW_OPTIMIZERS:
            raise InputError(f"row optimizer {self.rows!r}; accepted: {', '.join(ROW_OPTIMIZERS)}")
        if self.row_lr is None:
            object.__setattr__(self, "row_lr", ROW_LR[self.rows])
        if self.dense not in DENSE_OPTIMIZERS:
            raise InputError(f"dense optimizer {self.dense!r}; accepted: {', '.join(DENSE_OPTIMIZERS)}")
        for name in ("row_lr", "dense_lr", "eps"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v > 0):
                raise InputError(f"optimizer {name} = {v!r}; accepted: a finite number > 0")
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 <= v < 1):
                raise InputError(f"optimizer {name} = {v!r}; accepted: 0 <= value < 1")


def dense_state_copies(dense: str) -> int:
    """Values of state the dense optimizer `dense` keeps per parameter value."""
    return len(DENSE_SLOTS[dense])
