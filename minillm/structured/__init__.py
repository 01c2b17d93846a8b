"""Structured outputs and tool calling: request specs (spec.py), compiling them with xgrammar off the engine
thread (compiler.py), the runner's per-request matchers and step bitmasks (rows.py), and Qwen3-style tool
calls (tools.py). The sampler applies the bitmask (minillm/sampling/grammar_mask.py). docs/structured.md has
the design."""
