"""The models' parameter shapes and working-set sizes, as plain arithmetic without PyTorch: the config's
memory check (shardflow.config) prices a run with them before anything heavy is imported, and the
sequence model (shardflow.model.sequence) builds its encoder's parameters from the same shapes."""

from __future__ import annotations

MAX_SEED = 2**63 - 1  # a seed is a 64-bit signed integer, as numpy's generators and the batch order take it
MAX_TOP_K = 10_000  # the longest list of items a night writes per user (config nightly.top_k)

# The models' own defaults (configs.ModelConfig, configs.ClickConfig): what a model record written before a key
# existed was made with (clicks.read_record). The run's defaults are the recipe below.
DIM = 64
MLP = (64, 32)  # hidden widths of the (top) MLP
BOTTOM_MLP = (64,)  # click logs: hidden widths of the MLP over numeric columns
HISTORY = 20  # items of a user's history an example reads
NEGATIVES = 4  # sampled negatives per example
ENCODER = "mean"
BLOCKS, HEADS = 2, 1  # self-attention
DROPOUT = 0.5  # self-attention: SASRec's rate on sparse data
ITEM_DROPOUT = 0.0  # no item row's units dropped
LOSS = "bce"
GBCE_T = 0.75  # gBCE's calibration t: gSASRec's recommended value (Petrov & Macdonald, RecSys 2023, 5.3)

# The run's defaults (config_sections), the recipe docs/benchmarks.md measures on four sequence logs: the
# eSASRec benchmark's SASRec+SS setup (github blondered/transformer_benchmark: 1 block of 1 head, dropout 0.2, 50
# items of history, 256 negatives, Adam) with gSASRec's gBCE as its loss, the item rows' units dropped at the
# same rate once a step as the benchmark's pin (RecTools 0.13) drops its item table's, trained until the
# validation split's NDCG@10 has not improved for 10 epochs. A click log's model reads no history, samples no
# negatives and drops no item rows.
RUN_HISTORY, RUN_NEGATIVES, RUN_BLOCKS, RUN_DROPOUT, RUN_ITEM_DROPOUT = 50, 256, 1, 0.2, 0.2
RUN_EPOCHS, RUN_PATIENCE = 200, 10

# Keys whose default depends on what a dataset trains, filled in when the run's config is built (a key given
# stays). A sequence log: self-attention under gBCE, rows under Adam, as SASRec trains every parameter. A click
# log: the DLRM (it has no sequence encoder: mean stands for none) under BCE, rows under row-wise Adagrad, as
# DLRM and TorchRec train them.
WORKLOAD_DEFAULTS = {
    "sequences": {"encoder": "self-attention", "loss": "gbce", "row_optimizer": "adam"},
    "clicks": {"encoder": "mean", "loss": "bce", "row_optimizer": "adagrad"},
}


def attention_shapes(dim: int, history: int, blocks: int) -> dict[str, tuple[int, ...]]:
    """Every dense parameter of the self-attention encoder, by name: weights [in, out], biases and norms [dim]."""
    out: dict[str, tuple[int, ...]] = {"attention.position": (history, dim)}
    for b in range(blocks):
        p = f"attention.{b}"
        for name in ("query", "key", "value", "out", "ffn1", "ffn2"):
            out[f"{p}.{name}.weight"] = (dim, dim)
            if name != "key":  # a key bias adds the same to every score of a query: softmax cancels it
                out[f"{p}.{name}.bias"] = (dim,)
        for norm in ("norm1", "norm2"):
            out[f"{p}.{norm}.weight"], out[f"{p}.{norm}.bias"] = (dim,), (dim,)
    out["attention.norm.weight"], out["attention.norm.bias"] = (dim,), (dim,)
    return out


def activation_values(dim: int, history: int, blocks: int, heads: int) -> int:
    """A bound on the float32 values one example's step through the encoder holds at its peak (what the forward
    keeps for the backward, dropout's masks, the backward's temporaries). Measured as the peak RSS rise of one
    forward and backward of 1,024 examples in a fresh process (torch on CPU) at 1 to 4 blocks, 1 to 4 heads,
    history 20 to 100, dim 64 or 128, 4 or 256 negatives: 166 to 1,609 KB an example. The same step's peak
    varies by up to 1.4 x from process to process (history 50, 2 blocks of 2 heads: 727 to 1,032 MB), so this
    is 1.4 x the fit to the largest samples."""
    return history * dim * (32 + 24 * blocks) + blocks * 8 * heads * history * history


# A step's working set per trainer, in float32 values per looked-up row value: the rows pulled, their
# gradients, the candidates' products and their gradients (a generous bound, not an estimate to plan by).
STEP_COPIES = 4


def step_bytes(examples: int, dim: int, history: int, negatives: int, blocks: int = 0, heads: int = 1) -> int:
    """A bound on one trainer's working set in a step of `examples` (bytes): the rows it looks up (the history,
    the target, the negatives) STEP_COPIES times, and with self-attention (`blocks` > 0) what its encoder holds
    (activation_values)."""
    rows = examples * (history + 1 + negatives) * dim * STEP_COPIES
    attention = examples * activation_values(dim, history, blocks, heads) if blocks else 0
    return 4 * (rows + attention)
