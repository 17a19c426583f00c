"""lighteval's command line, for machines without network:

    python workflows/scripts/lighteval_offline.py accelerate ...   # as: lighteval accelerate ...

lighteval 0.13 fetches tinyBenchmarks.pkl from GitHub whenever its task registry imports
tiny_benchmarks.py, which every run does, for tasks we never run; a connection that fails
there ends the run. Here that fetch, and only it, answers a failed connection with a 503
response, which lighteval already takes as "not available" (it then saves nothing).
"""

import sys

import requests

TINY_BENCHMARKS = "https://raw.githubusercontent.com/felipemaiapolo/tinyBenchmarks/"
_get = requests.get


def get(url, *args, **kwargs):
    if not str(url).startswith(TINY_BENCHMARKS):
        return _get(url, *args, **kwargs)
    kwargs.setdefault("timeout", 10)
    try:
        return _get(url, *args, **kwargs)
    except requests.ConnectionError:
        response = requests.Response()
        response.status_code = 503
        response.url = str(url)
        return response


def main() -> int:
    requests.get = get
    from lighteval.__main__ import app

    return app()


if __name__ == "__main__":
    sys.exit(main())
