"""A launched function whose ranks start slowly: importing this module in a spawned rank (to
unpickle `ready_rank`) sleeps SLOW seconds before the rank can reach its process group, as
importing torch on a loaded machine does.  The test process itself imports it without delay."""
import multiprocessing
import time

SLOW = 3.0

if multiprocessing.parent_process() is not None:
    time.sleep(SLOW)


def ready_rank(rank, world_size):
    return rank
