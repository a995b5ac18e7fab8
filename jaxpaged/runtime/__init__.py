"""Process-wide settings that only entry points apply (the memory allocator)."""
