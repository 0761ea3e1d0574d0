package allocator

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/util/sets"
)

func TestPlanGroups(t *testing.T) {
	tests := []struct {
		name string
		// allocated GPUs per node before planning
		allocated map[string]int
		groups    func() []Group
		// wantNode: the node of a group (by index) when the plan succeeds
		wantNode   map[int]string
		wantErr    string
		wantNotFit bool
	}{{
		name:      "a pod's two claims land on one node even when each alone fits elsewhere",
		allocated: map[string]int{"n0": 5, "n1": 5}, // 3 free on each
		groups: func() []Group {
			return []Group{{Name: "pod a", Claims: []*resourceapi.ResourceClaim{gpuClaim("a1", 2, false), gpuClaim("a2", 2, false)}}}
		},
		wantErr:    "pod a (4 devices) does not fit",
		wantNotFit: true,
	}, {
		name: "a group's claims share a node",
		groups: func() []Group {
			return []Group{{Name: "pod a", Claims: []*resourceapi.ResourceClaim{gpuClaim("a1", 3, false), gpuClaim("a2", 3, false)}}}
		},
	}, {
		name: "a group limited to a node goes there",
		groups: func() []Group {
			return []Group{{Name: "pod a", Claims: []*resourceapi.ResourceClaim{gpuClaim("a1", 1, false)}, Nodes: sets.New("n1")}}
		},
		wantNode: map[int]string{0: "n1"},
	}, {
		name:      "a group limited to a full node does not fit",
		allocated: map[string]int{"n1": 8},
		groups: func() []Group {
			return []Group{{Name: "pod a", Claims: []*resourceapi.ResourceClaim{gpuClaim("a1", 1, false)}, Nodes: sets.New("n1")}}
		},
		wantErr:    "tried 1 of the 1 nodes it may use",
		wantNotFit: true,
	}, {
		name: "a claim in two groups is refused",
		groups: func() []Group {
			shared := gpuClaim("shared", 1, false)
			return []Group{{Name: "pod a", Claims: []*resourceapi.ResourceClaim{shared}}, {Name: "pod b", Claims: []*resourceapi.ResourceClaim{shared}}}
		},
		wantErr: "claim default/shared is given twice",
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := newCluster(t, "dgx-h100-nomig", "n0", "n1")
			for node, n := range tt.allocated {
				c.allocate(node, n)
			}
			in := c.input(FewestNVLinkDomains)
			in.Groups = tt.groups()
			r, err := Plan(context.Background(), in)
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				var nf *NotFitError
				assert.Equal(t, tt.wantNotFit, errors.As(err, &nf))
				return
			}
			require.NoError(t, err)
			var want int
			for _, g := range in.Groups {
				want += len(g.Claims)
			}
			require.Len(t, r.Allocations, want)
			for _, g := range in.Groups {
				for _, claim := range g.Claims {
					assert.Equal(t, nodeOf(r, claim.Name), nodeOf(r, g.Claims[0].Name), "claims of %s on different nodes", g.Name)
				}
			}
			for i, node := range tt.wantNode {
				assert.Equal(t, node, nodeOf(r, in.Groups[i].Claims[0].Name))
			}
		})
	}
}
