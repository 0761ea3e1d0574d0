package dashboard

import (
	"encoding/json"
	"testing"
)

func TestFixtureViewIsDeterministicAndConsistent(t *testing.T) {
	a, _ := json.Marshal(FixtureView(50, 8, 7))
	b, _ := json.Marshal(FixtureView(50, 8, 7))
	c, _ := json.Marshal(FixtureView(50, 8, 8))
	if string(a) != string(b) {
		t.Fatal("the same seed gives different Views")
	}
	if string(a) == string(c) {
		t.Fatal("another seed gives the same View")
	}

	v := FixtureView(200, 8, 1)
	var s Summary
	states := map[string]int{}
	for i, d := range v.Domains {
		if d.Name == "" && i != len(v.Domains)-1 {
			t.Errorf("the nodes in no NVLink domain are not last")
		}
		for _, n := range d.Nodes {
			s.Nodes++
			for _, g := range n.GPUs {
				s.GPUs++
				states[g.State]++
				if g.IdleClaimed {
					s.IdleClaimed++
				}
				allocated := 0
				for _, p := range g.Placements {
					overlapsAllocated := false
					for _, q := range g.Placements {
						if q.State == StateAllocated && q.Name != p.Name && p.Start < q.Start+q.Size && q.Start < p.Start+p.Size {
							overlapsAllocated = true
						}
					}
					switch {
					case p.State == StateAllocated && (overlapsAllocated || len(p.Holders) == 0):
						t.Errorf("%s/%s %s: allocated but overlapping another or held by nobody", n.Name, g.Name, p.Name)
					case p.State == StateBlocked && !overlapsAllocated, p.State == StateFree && overlapsAllocated:
						t.Errorf("%s/%s %s: %s, overlapping an allocated one: %v", n.Name, g.Name, p.Name, p.State, overlapsAllocated)
					}
					if p.State == StateAllocated {
						allocated++
					}
				}
				if g.MIG && (allocated > 0) != (g.State == StatePartial) {
					t.Errorf("%s/%s: state %s with %d allocated MIG devices", n.Name, g.Name, g.State, allocated)
				}
			}
		}
	}
	s.Allocated = states[StateAllocated] + states[StatePartial]
	s.Free, s.Unhealthy = states[StateFree], states[StateUnhealthy]
	s.Waiting = v.Summary.Waiting
	if s != v.Summary {
		t.Errorf("summary %+v, counted %+v", v.Summary, s)
	}
	for _, st := range []string{StateFree, StateAllocated, StatePartial, StateUnhealthy} {
		if states[st] == 0 {
			t.Errorf("no %s GPU in 1,600: the page's tests would not see one", st)
		}
	}
	if s.IdleClaimed == 0 || s.Waiting == 0 || len(v.Allocation.Series) == 0 {
		t.Errorf("idle claimed %d, waiting %d, allocation series %d: want some of each", s.IdleClaimed, s.Waiting, len(v.Allocation.Series))
	}
}
