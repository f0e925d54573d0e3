"""Train kvscope's bundled default model: a tiny Llama-architecture causal LM.

The model ships inside the package (``kvscope/models/bundled/``) so the server works
out of the box with no download. It is a demo model: it writes English-looking text,
not facts, and it is not an assistant.

Everything here runs offline on CPU and is reproducible from a fixed seed:

1. Build a plain-English corpus from redistributable text that is already on the
   machine (see ``corpus_sources``):
   - CPython's documentation topics, ``pydoc_data.topics.topics`` (PSF License);
   - the docstrings of the top-level modules of the CPython standard library (PSF License);
   - Debian's licence texts in ``/usr/share/common-licenses`` (each under its own terms).
   The text is split into paragraphs, whitespace is normalised, and paragraphs that
   look like code or markup rather than prose are dropped.
2. Train a byte-level BPE tokenizer (``tokenizers``) and wrap it as a Hugging Face
   ``PreTrainedTokenizerFast`` with ``<s>``/``</s>``/``<pad>`` and a simple chat template.
3. Train ``transformers.LlamaForCausalLM`` with AdamW and a cosine learning-rate
   schedule on random contiguous blocks of the token stream, holding out the tail of
   the stream for a validation loss.
4. Save model and tokenizer with ``save_pretrained`` (safetensors) and print a few
   greedy samples.

Usage (the defaults reproduce the bundled model)::

    python scripts/train_bundled.py
    python scripts/train_bundled.py --steps 50 --out /tmp/bundled-test   # quick smoke run
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import re
import sys
import sysconfig
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "kvscope" / "models" / "bundled"

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
LICENSE_DIR = Path("/usr/share/common-licenses")
SAMPLE_PROMPTS = (
    "Once upon a time",
    "The Python interpreter",
    "In this section",
    "The function",
    "In this example",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=688)
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=256, help="training sequence length")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=1100)
    p.add_argument("--max-minutes", type=float, default=24.0, help="stop training after this")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr")
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--no-licenses", action="store_true", help="leave out common-licenses")
    p.add_argument("--no-docstrings", action="store_true", help="leave out stdlib docstrings")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- corpus


def pydoc_topics() -> list[str]:
    """CPython's documentation topics (the text behind ``help('if')``), PSF License."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def stdlib_docstrings() -> list[str]:
    """Docstrings of the top-level modules of this Python's standard library, PSF License."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    docs.append(doc)
    return docs


def license_texts() -> list[str]:
    """Debian's common licence texts, one per distinct file (symlinks/duplicates skipped)."""
    seen, docs = set(), []
    for path in sorted(LICENSE_DIR.iterdir()):
        text = path.read_text(encoding="utf-8", errors="replace")
        if path.is_file() and text not in seen:
            seen.add(text)
            docs.append(text)
    return docs


def corpus_sources(args: argparse.Namespace) -> dict[str, list[str]]:
    sources = {"pydoc_data.topics.topics": pydoc_topics()}
    if not args.no_docstrings:
        sources["stdlib docstrings"] = stdlib_docstrings()
    if not args.no_licenses and LICENSE_DIR.is_dir():
        sources[str(LICENSE_DIR)] = license_texts()
    return sources


def is_prose(paragraph: str) -> bool:
    """Keep paragraphs that are mostly words: drops code, tables and reST underlines."""
    words = paragraph.split()
    if len(words) < 4 or paragraph.startswith((">>>", "$ ", "...")):
        return False
    letters = sum(c.isalpha() or c.isspace() for c in paragraph)
    wordy = sum(w.strip(".,;:()\"'!?").isalpha() for w in words)
    return letters / len(paragraph) >= 0.85 and wordy / len(words) >= 0.7


def clean(text: str) -> str:
    """Reflow each paragraph onto one line, normalise whitespace, keep prose paragraphs."""
    paragraphs = re.split(r"\n\s*\n", text.replace("\r\n", "\n"))
    kept = (" ".join(p.split()) for p in paragraphs)
    return "\n\n".join(p for p in kept if is_prose(p))


def build_corpus(args: argparse.Namespace) -> list[str]:
    docs = []
    for name, texts in corpus_sources(args).items():
        cleaned = [c for c in map(clean, texts) if c]
        chars = sum(map(len, cleaned))
        print(f"corpus: {name}: {len(texts)} texts -> {len(cleaned)} kept, {chars:,} chars")
        docs.extend(cleaned)
    print(f"corpus: total {len(docs)} documents, {sum(map(len, docs)):,} chars")
    return docs


# ------------------------------------------------------------------------ tokenizer


def train_tokenizer(docs: list[str], vocab_size: int, max_length: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE; encoding a text prepends ``<s>`` like Llama tokenizers do."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=max_length,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def encode_corpus(tokenizer: PreTrainedTokenizerFast, docs: list[str]) -> torch.Tensor:
    """One token stream: ``<s> doc </s> <s> doc </s> ...`` in a fixed shuffled order."""
    order = list(range(len(docs)))
    random.shuffle(order)
    encodings = tokenizer.backend_tokenizer.encode_batch([docs[i] for i in order])
    ids: list[int] = []
    for enc in encodings:
        ids.extend(enc.ids)  # starts with <s> (post-processor)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------------------- model


def make_model(args: argparse.Namespace, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_positions,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay from ``lr`` to ``lr * min_lr_ratio``."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


def random_batch(data: torch.Tensor, block: int, batch: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(data) - block, (batch,), generator=gen)
    return torch.stack([data[s : s + block] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, val: torch.Tensor, block: int) -> float:
    """Mean loss over consecutive non-overlapping blocks of the held-out stream."""
    model.eval()
    n = min(16, len(val) // block)
    blocks = val[: n * block].view(n, block)
    losses = [model(input_ids=b, labels=b).loss.item() for b in blocks.split(8)]
    model.train()
    return sum(losses) / len(losses)


def optimizer_for(model: LlamaForCausalLM, args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW; no weight decay on norms (1-d parameters)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def train(model, train_data, val_data, args) -> dict:
    opt = optimizer_for(model, args)
    gen = torch.Generator().manual_seed(args.seed)
    model.train()
    start, smoothed, step = time.monotonic(), None, 0
    bar = tqdm(range(args.steps), desc="train", mininterval=10, file=sys.stdout)
    for step in bar:
        if time.monotonic() - start > args.max_minutes * 60:
            print(f"time budget of {args.max_minutes} min reached at step {step}")
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        batch = random_batch(train_data, args.block_size, args.batch_size, gen)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
        bar.set_postfix(loss=f"{smoothed:.3f}", lr=f"{lr_at(step, args):.2e}", refresh=False)
        if (step + 1) % args.eval_every == 0:
            val = evaluate(model, val_data, args.block_size)
            tqdm.write(f"step {step + 1}: train loss {smoothed:.4f}  val loss {val:.4f}")
    else:
        step = args.steps
    bar.close()
    return {
        "steps": step,
        "minutes": (time.monotonic() - start) / 60,
        "train_loss": smoothed,
        "val_loss": evaluate(model, val_data, args.block_size),
    }


# ----------------------------------------------------------------------- save, show


def save(model, tokenizer, args: argparse.Namespace) -> None:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():  # the directory must hold only the model's files
        if stale.is_file():
            stale.unlink()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    model.to(getattr(torch, args.save_dtype)).save_pretrained(out, safe_serialization=True)
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    portable_tokenizer_class(out)
    for f in out.iterdir():
        f.chmod(0o644)  # save_pretrained writes model.safetensors owner-only
    model.float()
    total = sum(f.stat().st_size for f in out.iterdir())
    listing = ", ".join(sorted(f.name for f in out.iterdir()))
    print(f"saved {out} ({total / 1e6:.2f} MB): {listing}")


def portable_tokenizer_class(out: Path) -> None:
    """Name the tokenizer class ``PreTrainedTokenizerFast``: transformers 5 writes
    ``TokenizersBackend``, which transformers 4.x cannot load; both load the former."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def show_samples(model, tokenizer, prompts=SAMPLE_PROMPTS, new_tokens: int = 40) -> None:
    model.eval()
    for prompt in prompts:
        inputs = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
        text = tokenizer.decode(out[0], skip_special_tokens=True)
        print(f"--- {prompt!r}\n{text}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, threads {args.threads}")

    docs = build_corpus(args)
    tokenizer = train_tokenizer(docs, args.vocab_size, args.max_positions)
    data = encode_corpus(tokenizer, docs)
    n_val = int(len(data) * args.val_fraction)
    train_data, val_data = data[:-n_val], data[-n_val:]
    print(
        f"tokens: {len(train_data):,} train, {len(val_data):,} validation; vocab {len(tokenizer)}"
    )

    model = make_model(args, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters ({n_params / 1e6:.2f} M)")
    epochs = args.steps * args.batch_size * args.block_size / len(train_data)
    print(
        f"plan: {args.steps} steps x {args.batch_size} x {args.block_size} tokens "
        f"= {epochs:.1f} epochs, at most {args.max_minutes} min"
    )

    stats = train(model, train_data, val_data, args)
    print("result: " + json.dumps({k: round(v, 4) for k, v in stats.items()}))
    save(model, tokenizer, args)
    show_samples(model, tokenizer)


if __name__ == "__main__":
    main()
