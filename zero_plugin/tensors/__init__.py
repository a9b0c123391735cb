"""The bottom layer: flat-tensor layouts and weak autograd hooks, imported by every package above and importing
none of them."""
