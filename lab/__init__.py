"""The laboratory: what proves, measures, emulates or reproduces jax_hybridep; it imports the
package, the package never imports it, and it is never installed."""
