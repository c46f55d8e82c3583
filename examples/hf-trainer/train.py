"""A Hugging Face Trainer script with no reporting code of ours: run by a GpuTraining (or
``gpuop run``), it reports progress, loss and ETA to the operator by itself, because Transformers
switches its KubeflowCallback on whenever KUBEFLOW_TRAINER_SERVER_URL is set.

A tiny GPT-2 built from a config with random weights, trained on random token sequences the
script makes itself: nothing is downloaded, so it runs anywhere (CPU and gloo under torchrun,
or GPUs). Replace the model and the dataset with yours; nothing else changes.
"""

from __future__ import annotations

import argparse
import gc

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Fixed random sequences (seeded), labels = inputs: a language-modelling toy task."""

    def __init__(self, count: int, length: int, vocabulary: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocabulary, (count, length), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output-dir", default="/tmp/hf-trainer")
    parser.add_argument("--epochs", type=float, default=2)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()

    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.output_dir,
        num_train_epochs=args.epochs,
        per_device_train_batch_size=args.batch_size,
        learning_rate=1e-3,
        logging_steps=5,
        save_strategy="no",
        report_to="none",  # the Kubeflow callback is added all the same when the variable is set
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
    )
    data = RandomTokens(args.samples, 64, config.vocab_size)
    trainer = Trainer(model=model, args=training, train_dataset=data)
    trainer.train()
    # The Trainer leaves the process group open. Left to the interpreter's exit, gloo can abort a
    # rank ("terminate called without an active exception", pytorch/pytorch#190489), and
    # torchrun on the other node then waits out its 300 s exit barrier. Closed while the Trainer
    # still holds the DDP model, it can deadlock instead: the model's reducer frees the group
    # holding the GIL that gloo's worker thread needs. So the Trainer goes first, then the group.
    del trainer
    gc.collect()  # the Trainer and its Accelerator refer to each other
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
