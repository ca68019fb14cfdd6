"""Encoders other than BERT with the job's defaults: RoBERTa, DeBERTa-v2/v3, ELECTRA, DistilBERT and ModernBERT, each
tiny and random with the tiny BERT's tokenizer, trained by `main.py` without LORA_TARGET_MODULES, then served by
`predict.py`. The adapter's layers follow the architecture; the attention falls back to eager where SDPA is missing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.support.env import base_env
from tests.support.processes import run_main, run_predict

SENTENCES = ["a wonderful , moving film", "a dull and tedious mess"]
WIDTH = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}


def roberta(vocab: int, ids: dict):
    from transformers import RobertaConfig

    # RoBERTa counts positions from pad_token_id + 1: two more than the 128 tokens a row is cut to.
    return RobertaConfig(vocab_size=vocab, max_position_embeddings=130, type_vocab_size=2, **ids, **WIDTH)


def deberta_v3(vocab: int, ids: dict):
    from transformers import DebertaV2Config

    # DeBERTa-v3's shape: relative positions only, no absolute position embeddings.
    shape = dict(max_position_embeddings=512, position_biased_input=False, type_vocab_size=0, position_buckets=32)
    return DebertaV2Config(
        vocab_size=vocab, relative_attention=True, pos_att_type=["p2c", "c2p"], **shape, **ids, **WIDTH
    )


def electra(vocab: int, ids: dict):
    from transformers import ElectraConfig

    return ElectraConfig(vocab_size=vocab, embedding_size=32, max_position_embeddings=512, **ids, **WIDTH)


def distilbert(vocab: int, ids: dict):
    from transformers import DistilBertConfig

    width = dict(dim=32, n_layers=1, n_heads=2, hidden_dim=64)
    return DistilBertConfig(vocab_size=vocab, pad_token_id=ids["pad_token_id"], **width)


def modernbert(vocab: int, ids: dict):
    from transformers import ModernBertConfig

    ids = {**ids, "cls_token_id": ids["bos_token_id"], "sep_token_id": ids["eos_token_id"]}
    return ModernBertConfig(
        vocab_size=vocab, max_position_embeddings=512, global_attn_every_n_layers=1, **ids, **WIDTH
    )


# The family, its config, the layers the adapter must adapt there (the query and value projections), and whether it
# has a pooler module (the others' classifier reads the first token's hidden state).
FAMILIES = {
    "roberta": (roberta, ["query", "value"], False),
    "deberta-v2": (deberta_v3, ["query_proj", "value_proj"], True),
    "electra": (electra, ["query", "value"], False),
    "distilbert": (distilbert, ["q_lin", "v_lin"], False),
    "modernbert": (modernbert, ["Wqkv"], False),
}


def tiny_model(folder: Path, family: str, tiny_bert: Path) -> Path:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_bert)
    ids = dict(
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id
    )
    config = FAMILIES[family][0](len(tokenizer), ids)
    config.num_labels = 2
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_with_the_defaults_and_serves_with_predict(family, tiny_bert, sst2_dir, tmp_path):
    model = tiny_model(tmp_path / family, family, tiny_bert)
    out = tmp_path / "out"
    settings = dict(MAX_STEPS=4, PER_DEVICE_BATCH_SIZE=8, LEARNING_RATE="3e-3", REPORT_TO="none")
    result = run_main(base_env(tmp_path, MODEL_NAME=model, DATASET_PATH=sst2_dir, OUTPUT_DIR=out, **settings))
    assert result.code == 0, result.stderr[-3000:]
    _, targets, has_pooler = FAMILIES[family]
    adapter = json.loads((out / "model" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == sorted(targets)
    assert "eval_accuracy" in json.loads((out / "metrics.json").read_text())
    card = (out / "model" / "README.md").read_text()
    assert f"on {', '.join(sorted(targets))} |" in card  # the layers the adapter adapts, as trained
    # TRAIN_POOLER (a default) is a wish: the card and the log say what the model had, not what was asked
    pooler = "pooler" in (adapter.get("modules_to_save") or [])
    assert pooler == has_pooler
    assert ("pooler trained with the classifier" in card) == pooler, card
    log = (out / "logs" / "rank-0.log").read_text()
    assert ("has no pooler (its classifier reads the first token)" in log) == (not pooler), log[-3000:]
    assert "strategy ddp: one process, the whole model" in log and "launcher variables: " in log
    assert "environment {" not in log and "every rank" not in log
    [command] = re.findall(r"`python predict\.py ([^ `]+) sentences\.txt`", card)
    assert command == str(out / "model")

    (tmp_path / "sentences.txt").write_text("\n".join(SENTENCES) + "\n")
    predicted = run_predict(base_env(tmp_path), out / "model", "sentences.txt", cwd=tmp_path)
    assert predicted.code == 0, predicted.stderr[-3000:]
    answers = [json.loads(line) for line in predicted.stdout.splitlines()]
    assert [a["text"] for a in answers] == SENTENCES and {a["label"] for a in answers} <= {"negative", "positive"}
