package gpusmoke

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"

	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/pkg/mpsserver"
	"github.com/gpudra/gpudra/pkg/sharing"
)

// newClient is how the MPS control daemon logs each client that connects
// (control.log: "NEW CLIENT <pid> from user <uid>: ...").
var newClient = regexp.MustCompile(`NEW CLIENT [0-9]+ from user`)

// mpsServerLogs keeps the GPU node's MPS server logs (control.log and
// server.log in the server directory's log directory, as the daemon
// writes them) in the results, and counts the clients the control daemon
// logged.
func (s *session) mpsServerLogs(ctx context.Context) (clients int, err error) {
	servers, err := (&sharing.PodServers{Client: s.cluster.Client, Namespace: chart.PluginNamespace, NodeName: GPUNode}).List(ctx)
	if err != nil {
		return 0, fmt.Errorf("list the MPS server pods of node %s: %w", GPUNode, err)
	}
	if len(servers) == 0 {
		return 0, fmt.Errorf("node %s runs no MPS server pod while its MPS claim is in use", GPUNode)
	}
	for _, srv := range servers {
		for _, name := range []string{"control.log", "server.log"} {
			b, err := os.ReadFile(filepath.Join(srv.Dir, mpsserver.LogSubdir, name))
			if errors.Is(err, os.ErrNotExist) {
				continue // the stand-in keeps no logs; a server not started yet none
			}
			if err != nil {
				return 0, err
			}
			if err := s.res.write(filepath.Join("mps", srv.Key, name), string(b)); err != nil {
				return 0, err
			}
			if name == "control.log" {
				clients += len(newClient.FindAll(b, -1))
			}
		}
	}
	fmt.Fprintf(s.w, "   MPS server pods: %d; clients in the control daemon's log: %d\n", len(servers), clients)
	return clients, nil
}
