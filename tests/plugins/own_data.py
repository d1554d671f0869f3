"""Datasets defined outside mixprec, as a user writes them (`data=custom
data.target=own_data:blobs`): each callable returns its train and val datasets and what they
teach."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, TensorDataset


def blobs(n: int = 512, classes: int = 4, size: int = 8, seed: int = 0) -> dict:
    """1 x size x size images: a class's own fixed pattern plus noise (learnable in a few
    dozen steps)."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(classes, 1, size, size, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    x = patterns[y] + 0.8 * torch.randn(n, 1, size, size, generator=g)
    cut = n * 3 // 4
    return {
        "train": TensorDataset(x[:cut], y[:cut]),
        "val": TensorDataset(x[cut:], y[cut:]),
        "num_classes": classes,
    }


class Counting(Dataset):
    """Token sequences that count up modulo the vocabulary from a random start: the next token
    is always the current one plus one."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, vocab, (n,), generator=g)
        self.seq_len, self.vocab = seq_len, vocab

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int):
        seq = (self.starts[i] + torch.arange(self.seq_len + 1)) % self.vocab
        return seq[:-1], seq[1:]


def counting(n: int = 256, seq_len: int = 16, vocab: int = 32) -> dict:
    return {
        "train": Counting(n, seq_len, vocab, seed=0),
        "val": Counting(n // 4, seq_len, vocab, seed=1),
        "vocab_size": vocab,
    }


def rgb(n: int = 64) -> dict:
    """3-channel images (for a model that takes one channel: a shape error before training)."""
    x, y = torch.randn(n, 3, 8, 8), torch.randint(0, 4, (n,))
    return {"train": TensorDataset(x, y), "val": TensorDataset(x, y), "num_classes": 4}


def bad_labels(n: int = 64) -> dict:
    x, y = torch.randn(n, 1, 8, 8), torch.full((n,), 7)
    return {"train": TensorDataset(x, y), "val": TensorDataset(x, y), "num_classes": 4}


class Transformed(Dataset):
    """blobs' images through a transform given as a lambda, as users often write one: fine for
    forked loader workers, which inherit it; a forkserver's workers would need it pickled."""

    def __init__(self, data: Dataset, transform) -> None:
        self.data, self.transform = data, transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        x, y = self.data[i]
        return self.transform(x), y


def lambda_transform(scale: float = 2.0) -> dict:
    made = blobs(n=128)
    return {
        "train": Transformed(made["train"], lambda x: x * scale),
        "val": Transformed(made["val"], lambda x: x * scale),
        "num_classes": made["num_classes"],
    }


def no_val() -> dict:
    x, y = torch.randn(8, 1, 8, 8), torch.zeros(8, dtype=torch.long)
    return {"train": TensorDataset(x, y), "num_classes": 2}


class SlowVal(Dataset):
    """Validation images that take `delay` seconds each; item `mark_at` creates `marker` (the
    evaluation is under way: tests/test_hostile.py signals the run then). Once `marker`.quick
    exists they take no time (the same data: what a resume's evaluations read)."""

    def __init__(self, n: int, delay: float, marker: str, mark_at: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = (
            torch.randn(n, 1, 8, 8, generator=g),
            torch.randint(0, 4, (n,), generator=g),
        )
        self.delay, self.marker, self.mark_at = delay, marker, mark_at

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        import pathlib
        import time

        if i == self.mark_at:
            pathlib.Path(self.marker).touch()
        if not pathlib.Path(self.marker + ".quick").exists():
            time.sleep(self.delay)
        return self.x[i], self.y[i]


def slow_val(marker: str, n_val: int = 64, delay: float = 0.1) -> dict:
    data = blobs(n=256)
    data["val"] = SlowVal(n_val, delay, marker, mark_at=16)
    return data


class Dicts(Dataset):
    """A dataset whose samples are dicts, as Hugging Face datasets give them: `names` maps each
    entry of the wrapped (input, target) sample to its key; `extra` adds entries the model does
    not read (an attention mask, an id)."""

    def __init__(self, data: Dataset, names: tuple[str, str], extra: bool = True) -> None:
        self.data, self.names, self.extra = data, names, extra

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        x, y = self.data[i]
        sample = {self.names[0]: x, self.names[1]: y}
        if self.extra:
            sample.update(attention_mask=torch.ones_like(x, dtype=torch.long), idx=i)
        return sample


def blobs_dicts(input_key: str = "pixel_values", target_key: str = "label") -> dict:
    made = blobs()
    names = (input_key, target_key)
    return {**made, "train": Dicts(made["train"], names), "val": Dicts(made["val"], names)}


def counting_dicts() -> dict:
    made = counting()
    names = ("input_ids", "labels")
    return {**made, "train": Dicts(made["train"], names), "val": Dicts(made["val"], names)}


class Marked(Dataset):
    """Sequence classification, as a Hugging Face dataset gives it: dict samples of token ids
    and a label, the label whether token 1 (the mark) occurs in the sequence."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(2, vocab, (n, seq_len), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        where = torch.randint(0, seq_len, (n,), generator=g)
        self.ids[self.labels == 1, where[self.labels == 1]] = 1

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def marked(n: int = 512, seq_len: int = 16, vocab: int = 64) -> dict:
    return {
        "train": Marked(n, seq_len, vocab, seed=0),
        "val": Marked(n // 4, seq_len, vocab, seed=1),
        "num_classes": 2,
        "vocab_size": vocab,
    }


class Tagged(Dataset):
    """Token classification, as a Hugging Face dataset gives it: dict samples of token ids of
    varying length, their attention mask and a label per token (the token's class: its id mod
    `classes`, except that a token after the mark (1) is class 0: the label needs the context)."""

    def __init__(self, n: int, max_len: int, vocab: int, classes: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(max_len // 2, max_len + 1, (n,), generator=g)
        self.ids = torch.randint(1, vocab, (n, max_len), generator=g)
        self.classes = classes

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int):
        ids = self.ids[i, : self.lengths[i]]
        labels = ids % self.classes
        labels[1:][ids[:-1] == 1] = 0
        return {
            "input_ids": ids.tolist(),
            "attention_mask": [1] * len(ids),
            "labels": labels.tolist(),
        }


def word_tokenizer(vocab: int):
    """A tokenizer built here, nothing downloaded: ids 0..vocab-1, 0 the padding."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = {"[PAD]": 0, **{f"w{i}": i for i in range(1, vocab)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(words, unk_token="w1")), pad_token="[PAD]"
    )


def tagged(n: int = 512, max_len: int = 16, vocab: int = 32, classes: int = 3) -> dict:
    """Ragged samples padded per batch by transformers' DataCollatorForTokenClassification
    (ids with the pad token, labels with -100), as a Hugging Face pipeline batches them."""
    from transformers import DataCollatorForTokenClassification

    return {
        "train": Tagged(n, max_len, vocab, classes, seed=0),
        "val": Tagged(n // 4, max_len, vocab, classes, seed=1),
        "num_classes": classes,
        "vocab_size": vocab,
        "collate_fn": DataCollatorForTokenClassification(word_tokenizer(vocab)),
    }


def marked_masked(n: int = 512, seq_len: int = 16, vocab: int = 64) -> dict:
    """marked() with an attention mask that hides the second half of every sequence (a mark
    there is noise: the label counts only the first half's)."""
    made = marked(n, seq_len, vocab)
    for ds in (made["train"], made["val"]):
        ds.mask = torch.ones(seq_len, dtype=torch.long)
        ds.mask[seq_len // 2 :] = 0
        ds.labels = (ds.ids[:, : seq_len // 2] == 1).any(1).long()
    made["train"] = Masked(made["train"])
    made["val"] = Masked(made["val"])
    return made


class Masked(Dataset):
    def __init__(self, data: Marked) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return {**self.data[i], "attention_mask": self.data.mask}


class Holey(Dataset):
    """Dict samples of which one (`bad`) lacks its label, as a dataset with a broken row."""

    def __init__(self, data: Dataset, bad: int) -> None:
        self.data, self.bad = data, bad

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        x, y = self.data[i]
        return {"pixel_values": x} if i == self.bad else {"pixel_values": x, "label": y}


def holey_dicts(bad: int = 7) -> dict:
    made = blobs()
    return {**made, "train": Holey(made["train"], bad), "val": Holey(made["val"], -1)}


class Exploding:
    """A collate_fn that stacks as torch's default does, and raises on its `at`-th call in
    its process (a worker's calls are counted in the worker)."""

    def __init__(self, at: int, error: BaseException | None = None) -> None:
        self.at, self.calls = at, 0
        self.error = error or RuntimeError(f"collate exploded on call {at}")

    def __call__(self, samples: list):
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        from torch.utils.data import default_collate

        return default_collate(samples)


def exploding_collate(at: int = 4) -> dict:
    """blobs() with a collate_fn of the user's own that fails part-way into the run (its
    first call is mixprec's check of the first sample)."""
    return {**blobs(), "collate_fn": Exploding(at)}


def exiting_collate() -> dict:
    """A collate_fn that calls sys.exit(0) part-way into the run (in a worker, if any)."""
    return {**blobs(), "collate_fn": Exploding(4, SystemExit(0))}


def keyless_collate() -> dict:
    """A collate_fn that raises KeyError on its first call: mixprec's check of the first sample."""
    return {**blobs(), "collate_fn": Exploding(1, KeyError("input_ids"))}
