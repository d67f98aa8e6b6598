"""A seeded synthetic click log in Criteo's layout, with labels from a planted model with interactions.

For scale and for a quality check with a known answer, beside the real Criteo and Avazu
samples. Every row has counts I1..In (geometric, about 10% missing) and categorical
values C1..CT (Zipf over each table's values, written as 8 hex digits as Criteo's are).
The label is drawn from sigmoid(logit) with

    logit = bias + sum_t a[t, v_t] + sum_k w_k log(1 + x_k) + sum_{i<j<=P} <u[i, v_i], u[j, v_j]>

where a (first order) and u (INTERACTION_FACTORS-dim; P: the first INTERACTING tables of at
most INTERACTING_VALUES values, whose pairs a log of 10^5 rows shows often enough) are fixed
per (table, value) by a hash of the seed: a logistic regression over one-hot
values sees the first two terms, only a model with pairwise interactions sees all. The
file goes through the same importer as real logs (`shardflow import --format criteo`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from shardflow.data.synthetic import SynthTable, ZipfRows
from shardflow.errors import InputError
from shardflow.hashing import splitmix64

INTERACTION_FACTORS = 4
INTERACTING = 6  # tables whose values interact pairwise in the planted logit: the first six of at most 10^4 values
INTERACTING_VALUES = 10_000
BIAS = -1.2
BLOCK_ROWS = 1 << 16


def _unit(seed: int, table: int, values: np.ndarray, salt: int, width: int = 1) -> np.ndarray:
    """Uniform [-1, 1) numbers fixed by (seed, table, value, salt, column): [values, width]."""
    key = np.uint64(((seed & 0xFFFF) << 40) ^ (table << 24) ^ (salt << 8))
    counter: np.ndarray = values.astype(np.uint64)[:, None] * np.uint64(width) + np.arange(width, dtype=np.uint64)
    with np.errstate(over="ignore"):
        bits = splitmix64(splitmix64(counter ^ key))
    return (bits >> np.uint64(11)).astype(np.float64) / float(1 << 52) - 1.0


def synth_click_log(path: str | Path, rows: int, tables: list[tuple[int, float]], numeric: int = 13,
                    seed: int = 0) -> Path:
    """Write `rows` rows to the CSV file `path`: header label, I1..I<numeric>, C1..C<len(tables)>;
    table k has tables[k] = (values, Zipf alpha)."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise InputError(f"rows = {rows!r}; accepted: an integer >= 1")
    if not tables:
        raise InputError("no categorical tables; accepted: at least one (values, alpha) pair")
    if isinstance(numeric, bool) or not isinstance(numeric, int) or numeric < 0:
        raise InputError(f"numeric = {numeric!r}; accepted: an integer >= 0")
    zipf = [ZipfRows(SynthTable(f"C{k + 1}", n, alpha), (seed, k)) for k, (n, alpha) in enumerate(tables)]
    interacting = [k for k, (n, _) in enumerate(tables) if n <= INTERACTING_VALUES][:INTERACTING]
    fixed = np.random.default_rng([seed, 0xC1])
    weights, count_p = fixed.uniform(-0.4, 0.4, numeric), fixed.uniform(0.05, 0.6, numeric)
    names = ["label", *(f"I{k + 1}" for k in range(numeric)), *(f"C{k + 1}" for k in range(len(tables)))]
    path = Path(path)
    schema = pa.schema([(n, pa.int64() if n[0] != "C" else pa.string()) for n in names])
    options = pacsv.WriteOptions(include_header=False, quoting_style="none")
    with open(path, "wb") as f, pacsv.CSVWriter(f, schema, write_options=options) as out:
        f.write((",".join(names) + "\n").encode())
        for start in range(0, rows, BLOCK_ROWS):
            n = min(BLOCK_ROWS, rows - start)
            rng = np.random.default_rng([seed, start // BLOCK_ROWS])
            counts = rng.geometric(count_p, size=(n, numeric)) - 1
            missing = rng.random((n, numeric)) < 0.1
            logit = BIAS + np.log1p(counts) @ weights
            values = [z.sample(rng, n) for z in zipf]
            vectors = []
            for k, v in enumerate(values):
                logit += 0.5 * _unit(seed, k, v, 1)[:, 0]
                if k in interacting:
                    vectors.append(_unit(seed, k, v, 2, INTERACTION_FACTORS) * 0.9)
            for i in range(len(vectors)):
                for j in range(i + 1, len(vectors)):
                    logit += (vectors[i] * vectors[j]).sum(axis=1)
            label = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)
            columns = [pa.array(label)]
            columns += [pa.array(counts[:, k], mask=missing[:, k]) for k in range(numeric)]
            for k, v in enumerate(values):
                hashed = (_unit(seed, k, v, 3)[:, 0] * 2**31 + 2**31).astype(np.uint32)
                columns.append(pa.array(np.char.mod("%08x", hashed)))
            out.write_table(pa.table(columns, names=names))
    return path
