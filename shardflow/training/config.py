"""What a training run is asked to do (TrainConfig) and what it did: each epoch (EpochStats), the whole run
(TrainResult)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shardflow.data.examples import EVAL_NEGATIVES
from shardflow.errors import InputError
from shardflow.model.metrics import FULL_RANKING
from shardflow.model.sizes import MAX_SEED
from shardflow.planner.costmodel import check_dedup
from shardflow.training.validation import check_min_epochs

TRANSPORTS = ("auto", "actor", "collective")  # how a step's messages travel (shardflow.training.collective)


def resolve_transport(name: str, early_answers: bool, encrypted: bool = False) -> str:
    """The transport a run uses: `auto` is the collective one unless the run answers early or reaches its cluster
    over TLS, which only the actor calls carry (docs/training.md: the transports)."""
    check_transport(name, early_answers)
    if name != "auto":
        return name
    return "actor" if early_answers or encrypted else "collective"


def check_transport(name: str, early_answers: bool) -> None:
    if name not in TRANSPORTS:
        raise InputError(f"transport {name!r}; accepted: {', '.join(TRANSPORTS)}")
    if name == "collective" and early_answers:
        raise InputError("early_answers = true with transport 'collective'; accepted: early_answers false (an early "
                         "answer arrives outside the step's rounds, which the collective streams do not carry), or "
                         "transport 'actor'")


def check_seed(seed: object) -> None:
    """A seed of the batch order, the negatives and the held-out sample: a 64-bit signed integer, not negative."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise InputError(f"seed = {seed!r}; accepted: an integer from 0 to {MAX_SEED} (2^63 - 1)")


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 4096
    dedup: str = "device"
    epochs: int = 1
    max_steps: int | None = None  # stop after this many steps in all (None: run every epoch)
    steps_per_epoch: int | None = None  # the first steps of each epoch's order (None: all of them)
    device: str = "cpu"
    seed: int = 0
    eval_users: int | None = 5000  # users evaluated (a seeded sample; None: all)
    eval_negatives: int = EVAL_NEGATIVES  # ranked against each held-out item, none its user's (sample_unseen)
    window: tuple[int, int] = (0, 0)  # (first segment trained on, first evaluated on): see TrainData.load and ClickData
    early_answers: bool = False  # answer the next step's requests while waiting (protocol.py: PREFETCH)
    transport: str = "auto"  # how a step's messages travel: actor calls, or a gloo group (training/collective.py);
    # auto: the gloo group unless early_answers (resolve_transport)
    # Build the next step's batch on a thread of its own while this step runs (actor.Building). None: on a GPU
    # device, where the host is idle while the GPU computes; not on a CPU device, whose one core computes.
    build_ahead: bool | None = None
    # Hold out a validation split (each user's second-to-last item; a click log's last rows before the test
    # rows), score it after every epoch, stop after this many epochs without a better score and keep the
    # best epoch's parameters. None: no split, every epoch trained.
    patience: int | None = None
    min_epochs: int | None = None  # with patience: epochs trained before it may stop training (validation.stop_now)
    # With a validation split of a sequence workload: its held-out items also ranked among the whole catalog after
    # every epoch, where the rows live (Engine.rank_catalog; one of model.metrics.FULL_RANKING), and epochs chosen
    # on that NDCG@10 (validation.SCORE_KEYS). A run's config sets it (train.full_ranking); alone, the engine
    # scores the sampled protocol only.
    full_ranking: str = "off"

    def __post_init__(self) -> None:
        for name in ("batch_size", "epochs", "eval_negatives"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"{name} = {v!r}; accepted: an integer >= 1")
        for name in ("max_steps", "steps_per_epoch", "eval_users", "patience", "min_epochs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise InputError(f"{name} = {v!r}; accepted: an integer >= 1, or none")
        check_seed(self.seed)
        check_dedup(self.dedup)
        check_min_epochs(self.min_epochs, self.patience, self.epochs)
        if not isinstance(self.early_answers, bool):
            raise InputError(f"early_answers = {self.early_answers!r}; accepted: true or false")
        if self.build_ahead is not None and not isinstance(self.build_ahead, bool):
            raise InputError(f"build_ahead = {self.build_ahead!r}; accepted: true, false or none")
        object.__setattr__(self, "transport", resolve_transport(self.transport, self.early_answers))
        if self.full_ranking not in FULL_RANKING:
            raise InputError(f"full_ranking = {self.full_ranking!r}; accepted: {', '.join(FULL_RANKING)}")

    def builds_ahead(self) -> bool:
        """Whether the devices build the next step's batch on a thread of their own (build_ahead, None: on a GPU)."""
        return self.device == "cuda" if self.build_ahead is None else self.build_ahead

    @property
    def validation(self) -> bool:
        """Whether a validation split is held out of training."""
        return self.patience is not None


@dataclass(frozen=True)
class Span:
    """Steps, the examples they trained and the seconds they took; spans add up. `began` and `ended`: when the
    first of them began and the last ended, on time.monotonic's clock (CLOCK_MONOTONIC on Linux: one clock for
    every process of the host, so another process can line its own samples up with the steps)."""

    steps: int = 0
    examples: int = 0
    seconds: float = 0.0
    began: float = math.inf
    ended: float = -math.inf

    def __add__(self, other: Span) -> Span:
        return Span(self.steps + other.steps, self.examples + other.examples, self.seconds + other.seconds,
                    min(self.began, other.began), max(self.ended, other.ended))


@dataclass(frozen=True)
class EpochStats:
    """What one epoch did (Engine.train_epoch)."""

    epoch: int  # numbered from 0
    steps: int
    examples: int
    loss: float  # mean BCE per candidate (nan: no example)
    seconds: float
    parts: dict[str, float]  # the slowest device's seconds per part (batch, each round, compute), over the steps
    steady: Span  # the steps after the engine's warm-up steps
    steady_parts: dict[str, float]  # `parts` over those steps alone

    @property
    def examples_per_s(self) -> float:
        return self.examples / self.seconds if self.seconds else 0.0


@dataclass
class TrainResult:
    steps: int = 0
    examples: int = 0
    seconds: float = 0.0
    epoch_loss: list[float] = field(default_factory=list)  # mean BCE per epoch (per candidate)
    # mean seconds per step of each part (batch, each round, compute), over the steady steps as examples_per_s is
    # (all steps if there are none): a warm-up step reads its parts of the log from the store
    timings: dict[str, float] = field(default_factory=dict)
    steady: Span = Span()  # after the engine's warm-up steps
    # epoch (from 1) -> its val_ metrics, with a validation split
    validation: dict[int, dict[str, float | None]] = field(default_factory=dict)
    best_epoch: int | None = None  # the epoch whose parameters the engine holds at the end (validation split)

    @property
    def examples_per_s(self) -> float:
        """Over the steady-state steps (after the engine's WARMUP_STEPS), or all of them if there are none."""
        if self.steady.seconds > 0:
            return self.steady.examples / self.steady.seconds
        return self.examples / self.seconds if self.seconds else 0.0


def check_batch(batch_size: int, trainers: int, examples: int | None = None) -> None:
    """The one check of a global batch against the trainers it is split over (and the examples it is
    drawn from): at least one example per trainer on average, every epoch at least one step."""
    if batch_size < trainers:
        raise InputError(f"batch size {batch_size} < {trainers} trainers; accepted: batch size >= {trainers}, "
                         "one example per trainer")
    if examples is not None and batch_size > examples:
        raise InputError(f"batch size {batch_size} > {examples} training examples; accepted: at most {examples}")
