"""``kvown bench soak``: the long soak (kvown/apps/soak.py has the code and the rules).

    kvown bench soak --minutes 30 --timeout-s 2400 --json soak.json --plot soak.png

``kvown bench`` kills a run after ``--timeout-s`` (300 s by default): give it more than the soak's minutes.
"""

import sys

from kvown.apps.soak import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
