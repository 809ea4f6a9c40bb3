"""Write a small Llama-style Hugging Face model directory and a jsonl chat file, offline.

    python examples/make_tiny_llama.py OUT_DIR [--shard-size 200KB] [--conversations 256]

OUT_DIR/model: tokenizer (byte-level BPE trained with `tokenizers` on the Python standard library's
source, with pad/eos tokens and a chat template) + a random-init LlamaForCausalLM in safetensors,
both written with save_pretrained. OUT_DIR/chat.jsonl: {"messages": [...]} conversations.
Nothing is downloaded. The README's "Training your own model" fine-tunes it (ZeRO-3, 2 processes, resume, LoRA).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zerotrain.models.tiny_llama import build_tiny_llama, write_chat_jsonl  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--shard-size", default=None, help="e.g. 200KB: write sharded safetensors + index")
    parser.add_argument("--conversations", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    model_dir = build_tiny_llama(os.path.join(args.out_dir, "model"), vocab_size=args.vocab_size,
                                 hidden_size=args.hidden_size, num_layers=args.layers,
                                 max_shard_size=args.shard_size)
    chat = write_chat_jsonl(os.path.join(args.out_dir, "chat.jsonl"), n=args.conversations)
    print(f"model: {model_dir}\ndata:  {chat}")
    print("fine-tune it on 2 processes at ZeRO-3 (README, 'Training your own model'):\n"
          f"  zerotrain train --model {model_dir} --data {chat} --nproc 2 --seq-len 256 --max-steps 10 "
          "--learning-rate 3e-4 --per-device-train-batch-size 4 --save-steps 5 --output-dir ft --log-dir ft-log")


if __name__ == "__main__":
    main()
