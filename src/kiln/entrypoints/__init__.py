"""Command-line front ends that sit above the engine and the distributed runtime (`kiln generate`)."""
