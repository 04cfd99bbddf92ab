"""Loader for the zaya_toy_mc lm_eval task: the JSON-lines file beside this module as a one-split dataset."""

import json
import os

import datasets


def load(**_):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zaya_toy_mc.jsonl")
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
