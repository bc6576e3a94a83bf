"""Tools run beside the library: checkpoint writers and other command-line helpers."""
