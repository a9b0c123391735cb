"""Argument types shared by the ``zero-plugin`` commands: counts (``7B``), memory sizes (``24GiB``),
bandwidths (``450GB/s``), latencies (``3us``) and the ``--dtype`` choices."""

from __future__ import annotations

import argparse
import re

__all__ = ["DTYPES", "GIB", "parse_bytes", "parse_count", "parse_latency", "parse_rate"]

DTYPES = {"fp32": None, "bf16": "bf16", "fp16": "fp16"}
GIB = 2**30
_SIZE_UNITS = {
    "": GIB,
    "b": 1,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
}


def parse_count(text: str) -> int:
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9}
    t = text.strip().lower()
    try:
        return int(float(t[:-1]) * scale[t[-1]]) if t[-1] in scale else int(float(t))
    except (ValueError, IndexError, KeyError):
        raise argparse.ArgumentTypeError(f"--params must be a count like 7e9, 1.3B or 350M; got {text!r}") from None


def parse_bytes(text: str) -> float:
    """``24GiB``, ``80G`` (binary), ``24GB`` (decimal), ``512MiB``; a bare number is GiB."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a memory size like 24GiB, 80G, 40GB or 512MiB; got {text!r}")
    return float(m.group(1)) * _SIZE_UNITS[unit]


_BANDWIDTH_UNITS = {"gb/s": 1e9, "gbit/s": 1e9 / 8, "gbps": 1e9 / 8, "mb/s": 1e6, "tb/s": 1e12, "gib/s": 2**30, "": 1e9}
_LATENCY_UNITS = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "ns": 1e-9, "s": 1.0, "": 1e-6}


def parse_rate(text: str) -> float:
    """``450GB/s`` (bytes), ``400Gb/s`` or ``400Gbps`` (bits), ``50`` (GB/s): bytes per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*([a-zA-Zµ/]*)\s*", text)
    unit = m.group(2) if m else None
    key = None if unit is None else ("gbit/s" if unit in ("Gb/s", "Gbit/s") else unit.lower())
    if m is None or key not in _BANDWIDTH_UNITS or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a bandwidth like 450GB/s, 400Gb/s or 100Gbps; got {text!r}")
    return float(m.group(1)) * _BANDWIDTH_UNITS[key]


def parse_latency(text: str) -> float:
    """``3us``, ``0.01ms``, ``5e-6s``; a bare number is microseconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*([a-zA-Zµ]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _LATENCY_UNITS:
        raise argparse.ArgumentTypeError(f"expected a latency like 3us, 10us or 0.02ms; got {text!r}")
    return float(m.group(1)) * _LATENCY_UNITS[unit]
