"""Causal language modelling with the Hugging Face Trainer, in the shape of Transformers'
``examples/pytorch/language-modeling/run_clm.py``: the same arguments, the same steps (config
and tokenizer, a model from a config or a checkpoint, tokenize, group into blocks, train,
save, evaluate). Nothing in it knows shardwise: ``--deepspeed ds_config.json`` makes the Trainer
use the installed ``deepspeed`` distribution, which the shim (integrations/deepspeed-shim)
answers with shardwise. Two differences from the original, both to run without the network:
text files are read by a few lines of Python instead of the ``datasets`` library, and the
tokenizer is a local directory (``tokenizer/``, one token per character).

    torchrun --nproc-per-node 2 run_clm.py --model_type gpt2 \
        --config_overrides n_embd=32,n_layer=2,n_head=2,n_positions=64 \
        --tokenizer_name tokenizer --train_file data/train.txt --validation_file data/validation.txt \
        --block_size 32 --per_device_train_batch_size 2 --do_train --do_eval \
        --output_dir out --deepspeed ds_config_zero2.json     (docs/hf-trainer.md)
"""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass, field
from itertools import chain

import torch
import transformers
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    """Which model/config/tokenizer to fine-tune, or train from scratch."""

    model_name_or_path: str | None = field(default=None, metadata={"help": "A checkpoint."})
    model_type: str | None = field(default=None, metadata={"help": "Train from scratch."})
    config_overrides: str | None = field(
        default=None, metadata={"help": "From scratch: n_embd=10,resid_pdrop=0.2,..."}
    )
    config_name: str | None = field(default=None)
    tokenizer_name: str | None = field(default=None)
    torch_dtype: str | None = field(
        default=None, metadata={"choices": ["auto", "bfloat16", "float16", "float32"]}
    )

    def __post_init__(self) -> None:
        if self.config_overrides is not None and (
            self.config_name is not None or self.model_name_or_path is not None
        ):
            raise ValueError(
                "--config_overrides can't be used in combination with --config_name or "
                "--model_name_or_path"
            )


@dataclass
class DataTrainingArguments:
    """What data to train and evaluate on."""

    train_file: str | None = field(default=None, metadata={"help": "A text file."})
    validation_file: str | None = field(default=None, metadata={"help": "A text file."})
    max_train_samples: int | None = field(default=None)
    max_eval_samples: int | None = field(default=None)
    block_size: int | None = field(
        default=None, metadata={"help": "Sequence length after tokenization."}
    )
    keep_linebreaks: bool = field(default=True)

    def __post_init__(self) -> None:
        if self.train_file is None and self.validation_file is None:
            raise ValueError("Need a training or a validation file.")


def load_text(path: str, keep_linebreaks: bool) -> list[str]:
    """The ``text`` builder of ``datasets``: one example per line."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines(keepends=keep_linebreaks)
    return [line for line in lines if line.strip()]


def group_texts(examples: dict[str, list], block_size: int) -> dict[str, list]:
    """Concatenate all texts and cut them into ``block_size`` chunks (the remainder is dropped)."""
    concatenated = {k: list(chain(*examples[k])) for k in examples}
    total_length = len(concatenated[next(iter(examples))])
    total_length = (total_length // block_size) * block_size
    result = {
        k: [t[i : i + block_size] for i in range(0, total_length, block_size)]
        for k, t in concatenated.items()
    }
    result["labels"] = result["input_ids"].copy()
    return result


def as_rows(columns: dict[str, list], limit: int | None) -> list[dict[str, torch.Tensor]]:
    rows = [
        dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)
    ]
    rows = rows[:limit] if limit is not None else rows
    return [{k: torch.tensor(v) for k, v in row.items()} for row in rows]


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(
            json_file=os.path.abspath(sys.argv[1])
        )
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses()

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    logger.warning(
        f"Process rank: {training_args.local_process_index}, device: {training_args.device}, "
        f"n_gpu: {training_args.n_gpu}, distributed training: {training_args.parallel_mode.value}"
    )

    # Detecting last checkpoint.
    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
        if last_checkpoint is not None and training_args.resume_from_checkpoint is None:
            logger.info(f"Checkpoint detected, resuming training at {last_checkpoint}.")

    set_seed(training_args.seed)

    raw = {}
    if data_args.train_file is not None:
        raw["train"] = {"text": load_text(data_args.train_file, data_args.keep_linebreaks)}
    if data_args.validation_file is not None:
        raw["validation"] = {
            "text": load_text(data_args.validation_file, data_args.keep_linebreaks)
        }

    if model_args.config_name:
        config = AutoConfig.from_pretrained(model_args.config_name)
    elif model_args.model_name_or_path:
        config = AutoConfig.from_pretrained(model_args.model_name_or_path)
    else:
        config = CONFIG_MAPPING[model_args.model_type]()
        logger.warning("You are instantiating a new config instance from scratch.")
        if model_args.config_overrides is not None:
            logger.info(f"Overriding config: {model_args.config_overrides}")
            config.update_from_string(model_args.config_overrides)
            logger.info(f"New config: {config}")

    if model_args.tokenizer_name:
        tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name)
    elif model_args.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    else:
        raise ValueError("Instantiating a new tokenizer from scratch is not supported here.")

    if model_args.model_name_or_path:
        torch_dtype = (
            model_args.torch_dtype
            if model_args.torch_dtype in ["auto", None]
            else getattr(torch, model_args.torch_dtype)
        )
        model = AutoModelForCausalLM.from_pretrained(
            model_args.model_name_or_path, config=config, dtype=torch_dtype
        )
    else:
        model = AutoModelForCausalLM.from_config(config)
        n_params = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())
        logger.info(f"Training new model from scratch - Total size={n_params / 2**20:.2f}M params")

    # We resize the embeddings only when necessary to avoid index errors.
    embedding_size = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > embedding_size:
        model.resize_token_embeddings(len(tokenizer))

    with training_args.main_process_first(desc="dataset map tokenization"):
        tokenized = {
            split: {k: list(v) for k, v in tokenizer(columns["text"]).items()}
            for split, columns in raw.items()
        }

    if data_args.block_size is None:
        block_size = min(tokenizer.model_max_length, 1024)
    else:
        block_size = min(data_args.block_size, tokenizer.model_max_length)

    with training_args.main_process_first(desc="grouping texts together"):
        lm = {split: group_texts(columns, block_size) for split, columns in tokenized.items()}

    train_dataset = eval_dataset = None
    if training_args.do_train:
        if "train" not in lm:
            raise ValueError("--do_train requires a train dataset")
        train_dataset = as_rows(lm["train"], data_args.max_train_samples)
    if training_args.do_eval:
        if "validation" not in lm:
            raise ValueError("--do_eval requires a validation dataset")
        eval_dataset = as_rows(lm["validation"], data_args.max_eval_samples)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )

    if training_args.do_train:
        checkpoint = None
        if training_args.resume_from_checkpoint is not None:
            checkpoint = training_args.resume_from_checkpoint
        elif last_checkpoint is not None:
            checkpoint = last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()  # Saves the tokenizer too for easy upload

        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        try:
            perplexity = math.exp(metrics["eval_loss"])
        except OverflowError:
            perplexity = float("inf")
        metrics["perplexity"] = perplexity
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
