"""Tools a contributor reruns (see scripts/README.md); run each as ``python3 -m scripts.<name>``."""
