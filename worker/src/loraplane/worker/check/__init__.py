"""Numerical checks of the runtime against independent references."""
