"""The wire: process groups and their collectives, flat buffers, the low-bit codec and its exchange, the node
groups of islands. Every collective the library issues starts here.

Nothing in this package knows what a round or an Averager is.
"""
