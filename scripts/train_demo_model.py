"""Train the shipped demo model: a tiny MarianMT that translates French number words to English.

    .venv/bin/python scripts/train_demo_model.py [--output onnxmerge/demo/model]

Trains on CPU in a few minutes, seeded, then reports exact-match accuracy of greedy generation on
the held-out numbers (see ``onnxmerge.demo.is_held_out``) and writes the checkpoint and tokenizer.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import GenerationConfig, MarianConfig, MarianMTModel, PreTrainedTokenizerFast

# Run from a checkout without installing: import the package next to this script.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from onnxmerge.demo import (  # noqa: E402
    DEMO_MODEL_DIR,
    DEMO_SENTENCES,
    LARGEST_NUMBER,
    english_number,
    french_number,
    is_held_out,
)

EOS, UNK, PAD = "</s>", "<unk>", "<pad>"
MAX_LENGTH = 32


def build_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over both languages; hyphens are tokens of their own.

    Words carry a leading "▁" the way sentencepiece marks a preceding space, so decoding restores
    the text exactly: "forty-three" is ["▁forty", "-", "three"].
    """
    pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
            pre_tokenizers.Split("-", behavior="isolated"),
        ]
    )
    words = sorted({piece for text in texts for piece, _ in pre_tokenizer.pre_tokenize_str(text)})
    # Marian's layout: eos first, unk next, pad last.
    vocab = {EOS: 0, UNK: 1}
    for word in words:
        vocab[word] = len(vocab)
    vocab[PAD] = len(vocab)

    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    # Like Marian, every encoded text ends with eos.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS}", pair=f"$A $B {EOS}", special_tokens=[(EOS, vocab[EOS])]
    )
    tokenizer.add_special_tokens([EOS, UNK, PAD])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        model_max_length=MAX_LENGTH,
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> MarianMTModel:
    # opus-mt's choices (swish, scaled and shared embeddings, post-norm), shrunk.
    config = MarianConfig(
        vocab_size=len(tokenizer),
        decoder_vocab_size=len(tokenizer),
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=256,
        decoder_ffn_dim=256,
        max_position_embeddings=64,
        activation_function="swish",
        dropout=0.1,
        attention_dropout=0.0,
        activation_dropout=0.0,
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        forced_eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = MarianMTModel(config)
    model.generation_config = GenerationConfig(
        max_length=MAX_LENGTH,
        num_beams=1,
        do_sample=False,
        decoder_start_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        forced_eos_token_id=tokenizer.eos_token_id,
    )
    return model


def translate(
    model: MarianMTModel,
    tokenizer: PreTrainedTokenizerFast,
    sources: list[str],
    batch_size: int = 256,
) -> list[str]:
    model.eval()
    outputs: list[str] = []
    with torch.no_grad():
        for start in range(0, len(sources), batch_size):
            chunk = sources[start : start + batch_size]
            batch = tokenizer(chunk, return_tensors="pt", padding=True)
            generated = model.generate(**batch)
            outputs += tokenizer.batch_decode(generated, skip_special_tokens=True)
    return outputs


def train(
    model: MarianMTModel,
    tokenizer: PreTrainedTokenizerFast,
    numbers: list[int],
    *,
    epochs: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
) -> None:
    encoded = tokenizer(
        [french_number(n) for n in numbers],
        text_target=[english_number(n) for n in numbers],
    )
    sources, targets = encoded["input_ids"], encoded["labels"]
    steps_per_epoch = math.ceil(len(numbers) / batch_size)
    total_steps = epochs * steps_per_epoch
    warmup_steps = min(300, total_steps // 10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: (
            min(1.0, (step + 1) / warmup_steps)
            * 0.5
            * (1.0 + math.cos(math.pi * min(1.0, step / total_steps)))
        ),
    )
    order = random.Random(seed)
    indices = list(range(len(numbers)))
    pad = tokenizer.pad_token_id
    began = time.perf_counter()
    for epoch in range(epochs):
        model.train()
        order.shuffle(indices)
        epoch_loss = 0.0
        for start in range(0, len(indices), batch_size):
            batch = indices[start : start + batch_size]
            input_ids = _pad([sources[i] for i in batch], pad)
            labels = _pad([targets[i] for i in batch], -100)
            loss = model(
                input_ids=input_ids, attention_mask=(input_ids != pad).long(), labels=labels
            ).loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            epoch_loss += loss.item() * len(batch)
        if epoch % 5 == 4 or epoch == 0 or epoch == epochs - 1:
            print(
                f"epoch {epoch + 1:3d}/{epochs}  loss {epoch_loss / len(indices):.4f}"
                f"  ({time.perf_counter() - began:.0f} s)",
                flush=True,
            )


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(row) for row in rows)
    return torch.tensor([row + [value] * (width - len(row)) for row in rows], dtype=torch.long)


def save(model: MarianMTModel, tokenizer: PreTrainedTokenizerFast, output: Path) -> None:
    if output.exists():
        shutil.rmtree(output)
    output.mkdir(parents=True)
    model.save_pretrained(output, safe_serialization=True)
    tokenizer.save_pretrained(output)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    # One thread: on small CPU machines two threads ran these tiny matmuls several times slower.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    every_number = range(LARGEST_NUMBER + 1)
    train_numbers = [n for n in every_number if not is_held_out(n)]
    held_out = [n for n in every_number if is_held_out(n)]

    texts = [convert(n) for n in every_number for convert in (french_number, english_number)]
    tokenizer = build_tokenizer(texts)
    model = build_model(tokenizer, args.seed)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"vocab {len(tokenizer)}, {parameters} parameters, {len(train_numbers)} training pairs")

    began = time.perf_counter()
    train(
        model,
        tokenizer,
        train_numbers,
        epochs=args.epochs,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        seed=args.seed,
    )
    print(f"trained in {time.perf_counter() - began:.0f} s")

    predictions = translate(model, tokenizer, [french_number(n) for n in held_out])
    wrong = [
        (n, got) for n, got in zip(held_out, predictions, strict=True) if got != english_number(n)
    ]
    accuracy = 1 - len(wrong) / len(held_out)
    print(f"held-out exact match: {accuracy:.2%} ({len(held_out) - len(wrong)}/{len(held_out)})")
    for n, got in wrong[:20]:
        print(f"  {n}: {french_number(n)!r} -> {got!r}, expected {english_number(n)!r}")
    for source, target in zip(
        DEMO_SENTENCES, translate(model, tokenizer, list(DEMO_SENTENCES)), strict=True
    ):
        print(f"  {source!r} -> {target!r}")

    save(model, tokenizer, args.output)
    size = (args.output / "model.safetensors").stat().st_size
    print(f"wrote {args.output} (model.safetensors: {size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
