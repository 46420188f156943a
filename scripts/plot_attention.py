"""Pictures of what the formulas compute: attention maps (layer x head) for a sentence, and the
sinusoidal positional-encoding matrix.

    python scripts/plot_attention.py --model minilm-impl/ --text "The cat sat on the mat because it was tired." \\
        --out docs/attention_minilm.png --pe_out docs/sinusoidal_encoding.png
    python scripts/plot_attention.py --model my-bert --text "Paris is the capital of France." --layers 0 5
    python scripts/plot_attention.py --model my-bert --pe_out pe.png --pe_positions 128   # only the encoding

The attention maps are the real probabilities softmax(QKᵀ/√d_k) that the model returns with
`output_attentions=True` (row = query token, column = key token; each row sums to 1). The encoding
picture is `sinusoidal_position_encoding(positions, hidden_size)`; when the checkpoint has a
learned position table (e.g. a converted transformers BERT) it is drawn beside it.
Make a model directory from a transformers BERT with scripts/convert_checkpoint.py --from-hf.
"""

import os
import sys
from dataclasses import dataclass, field

import matplotlib


matplotlib.use("Agg")  # files only; no display on servers
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer, HfArgumentParser  # noqa: E402

from hf_bert_impl import BertImplModel, sinusoidal_position_encoding  # noqa: E402


@dataclass
class PlotArguments:
    model: str = field(metadata={"help": "directory of a saved bert_impl checkpoint (any head)"})
    text: str | None = field(default=None, metadata={"help": "the sentence whose attention to draw"})
    out: str = field(default="attention.png", metadata={"help": "PNG of the attention grid"})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer directory (default: --model)"})
    layers: list[int] | None = field(default=None, metadata={"help": "layers to draw (default: all)"})
    max_tokens: int = field(default=24, metadata={"help": "truncate the sentence to this many tokens"})
    pe_out: str | None = field(default=None, metadata={"help": "also write a PNG of the sinusoidal encoding"})
    pe_positions: int | None = field(
        default=None, metadata={"help": "positions in it (default: max_position_embeddings)"}
    )


def attention_maps(model, tokenizer, text: str, max_tokens: int):
    """Tokens and a (layers, heads, s, s) tensor of attention probabilities for `text`."""
    enc = tokenizer(text, return_tensors="pt", truncation=True, max_length=max_tokens)
    with torch.no_grad():
        out = model(**enc, output_attentions=True)
    probs = torch.stack([a[0] for a in out.attentions])  # (L, h, s, s)
    row_sums = probs.sum(-1)
    if not torch.isfinite(probs).all() or not torch.allclose(row_sums, torch.ones_like(row_sums), atol=1e-5):
        raise ValueError("the model returned attention rows that are not probability distributions")
    return tokenizer.convert_ids_to_tokens(enc["input_ids"][0]), probs


def plot_attention_grid(tokens, probs, layers, path: str, title: str):
    n_layers, n_heads = len(layers), probs.shape[1]
    size = 1.25 + 0.06 * len(tokens)
    fig, axes = plt.subplots(n_layers, n_heads, figsize=(n_heads * size + 1.5, n_layers * size + 1.2), squeeze=False)
    for r, layer in enumerate(layers):
        for h in range(n_heads):
            ax = axes[r][h]
            image = ax.imshow(probs[layer, h].numpy(), vmin=0.0, vmax=1.0, cmap="viridis")
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(f"head {h}", fontsize=8)
            if h == 0:  # token labels once per row and column of the grid keep it readable
                ax.set_yticks(range(len(tokens)), tokens, fontsize=5)
                ax.set_ylabel(f"layer {layer}", fontsize=8)
            if r == n_layers - 1:
                ax.set_xticks(range(len(tokens)), tokens, fontsize=5, rotation=90)
    fig.suptitle(title, fontsize=10, y=0.93)
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention probability (row: query, column: key)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_position_encoding(model, positions: int, path: str):
    dim = model.config.hidden_size
    pe = sinusoidal_position_encoding(positions, dim)
    learned = getattr(model.embeddings, "position_embeddings", None)
    panels = [
        (
            pe,
            f"sinusoidal_position_encoding({positions}, {dim})\n"
            "PE(pos, 2i) = sin(pos / 10000^(2i/d)),  PE(pos, 2i+1) = cos(pos / 10000^(2i/d))",
        )
    ]
    if learned is not None:
        table = learned.weight.detach()[:positions]
        panels.append(
            (
                table,
                f"this checkpoint's learned position table ({table.shape[0]} x {dim})\n"
                "colour clipped at the 99.5th percentile of |value|",
            )
        )
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5.5), squeeze=False)
    for ax, (table, title) in zip(axes[0], panels):
        # Learned tables have a few large outliers that would wash the rest out: clip the colour scale.
        limit = float(table.abs().max()) if table is pe else float(table.abs().flatten().quantile(0.995))
        image = ax.imshow(
            table.numpy(), aspect="auto", cmap="RdBu_r", vmin=-limit, vmax=limit, interpolation="nearest"
        )
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("dimension (even: sin, odd: cos)" if table is pe else "dimension")
        ax.set_ylabel("position")
        fig.colorbar(image, ax=ax, shrink=0.8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    (args,) = HfArgumentParser(PlotArguments).parse_args_into_dataclasses(args=argv)
    if not os.path.isdir(args.model):
        print(f"plot_attention: error: --model {args.model!r} is not a directory", file=sys.stderr)
        return 2
    if args.text is None and args.pe_out is None:
        print(
            "plot_attention: error: nothing to draw; pass --text (attention) and/or --pe_out (encoding)",
            file=sys.stderr,
        )
        return 2
    if args.text is not None and not args.text.strip():
        print("plot_attention: error: --text is empty", file=sys.stderr)
        return 2
    try:
        model = BertImplModel.from_pretrained(args.model).eval()
        n_layers = model.config.num_hidden_layers
        layers = args.layers if args.layers is not None else list(range(n_layers))
        bad = [i for i in layers if not 0 <= i < n_layers]
        if bad:
            raise ValueError(f"--layers {bad} outside [0, {n_layers}) for this {n_layers}-layer model")
        if args.text is not None:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
            tokens, probs = attention_maps(model, tokenizer, args.text, args.max_tokens)
            name = os.path.basename(os.path.normpath(args.model))
            plot_attention_grid(tokens, probs, layers, args.out, f"{name}: attention probabilities for {args.text!r}")
            print(f"wrote {args.out}: {len(layers)} layers x {probs.shape[1]} heads, {len(tokens)} tokens {tokens}")
            for layer in layers:  # one number per layer so the picture's story is checkable in text
                p = probs[layer]
                entropy = -(p * p.clamp_min(1e-12).log()).sum(-1).mean().item()
                to_cls = p[..., 0].mean().item()
                print(
                    f"  layer {layer}: mean row entropy {entropy:.3f} nats, mean attention to {tokens[0]} {to_cls:.3f}"
                )
        if args.pe_out is not None:
            positions = args.pe_positions or model.config.max_position_embeddings
            if positions <= 0:
                raise ValueError(f"--pe_positions must be positive, got {positions}")
            plot_position_encoding(model, positions, args.pe_out)
            print(f"wrote {args.pe_out}: sinusoidal encoding {positions} x {model.config.hidden_size}")
    except (ValueError, OSError) as e:
        print(f"plot_attention: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
