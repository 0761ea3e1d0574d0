package plugin

import (
	"context"
	"errors"
	"fmt"
	"sync"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// Driver implements kubeletplugin.DRAPlugin over a NodeState.
type Driver struct {
	state   *NodeState
	backend nvdevice.Interface
	pool    string
	// publish is called whenever the node's devices change.
	publish func(context.Context) error
	// cancel stops the plugin on a fatal background error.
	cancel context.CancelCauseFunc

	metrics *Metrics
	// client writes device statuses (shares and their limits).
	client kubernetes.Interface
	// fractional publishes whole GPUs as shareable (consumable capacity).
	fractional bool
	// dcgmExporterAttributes publishes the MIG attributes dcgm-exporter
	// reads (slicebuilder.Options.DCGMExporterAttributes).
	dcgmExporterAttributes bool
	// migPolicy says which MIG devices are published (--mig-devices).
	migPolicy slicebuilder.MigPolicy
	// existingMigOnly offers only MIG devices that exist (feature gate
	// DynamicMIG off): a placement the plugin would have to create is not
	// published, so no claim is scheduled only to be refused at prepare.
	existingMigOnly bool
	// unpublished are the GPUs in MIG mode that published nothing at the
	// last build (reportUnpublished; guarded by mu).
	unpublished []int

	// taintEffect is the effect of the taint on an unhealthy GPU's devices:
	// NoSchedule (default) keeps new claims off; NoExecute also evicts the
	// pods using them (the device-taint eviction controller does).
	taintEffect resourceapi.DeviceTaintEffect

	// healthStore keeps the unhealthy GPUs across restarts (set before the
	// health watch starts, then read by it only).
	healthStore *healthStore
	// xidPolicy says which XIDs make a GPU unhealthy (zero: the default).
	xidPolicy nvdevice.XIDPolicy
	// healthObs is told what the health watch sees (nil: nobody).
	healthObs HealthObserver
	// events records Events on the Node (nil: none).
	events *nodeEvents
	// repub runs republishes, retried until they succeed (republish.go).
	repub *republisher
	// driverSpec is the node's common CDI spec, which every prepared
	// device references (nil: none).
	driverSpec *driverSpec

	mu      sync.Mutex
	health  map[string]nvdevice.HealthEvent // unhealthy GPUs by UUID
	changed chan struct{}                   // closed on a health change
	// gpuNames: GPU UUID -> device name, of every GPU published so far.
	gpuNames map[string]string
	// built and builtFrom are what Resources built last and the inventory
	// it read: the health reports use them, so that they never wait for
	// the node lock or NVML, which a blocked prepare may hold.
	built     *resourceslice.DriverResources
	builtFrom *nvdevice.Inventory
	// driverGone: the last inventory read found the NVIDIA driver not
	// loaded (driverload.go); every GPU is tainted until it is back.
	driverGone bool
}

var _ kubeletplugin.DRAPlugin = (*Driver)(nil)

// PrepareResourceClaims prepares each claim; a claim's error goes into its
// own result so the other claims of the call still succeed.
func (d *Driver) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	logger := klog.FromContext(ctx)
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, c := range claims {
		start := d.metrics.begin(opPrepare)
		rec, err := d.state.Prepare(ctx, c)
		d.metrics.observe(opPrepare, start, err)
		if err != nil {
			logger.Error(err, "Prepare failed", "claim", klog.KObj(c))
			d.events.prepareFailed(c, err)
			out[c.UID] = kubeletplugin.PrepareResult{Err: err}
			continue
		}
		res := kubeletplugin.PrepareResult{}
		for _, pd := range rec.Devices {
			res.Devices = append(res.Devices, kubeletplugin.Device{
				Requests: pd.Requests, PoolName: pd.Pool, DeviceName: pd.Device, CDIDeviceIDs: d.driverSpec.deviceIDs(pd.CDIDeviceIDs),
			})
		}
		out[c.UID] = res
		if err := writeDeviceStatus(ctx, d.client, slicebuilder.DriverName+"/"+d.pool, c, rec); err != nil {
			logger.Error(err, "Writing the claim's device status failed", "claim", klog.KObj(c))
		}
	}
	// No republish, even when a MIG device was created: the claim was
	// allocated a published placement, which stays published as it was
	// (whatever the MIG policy, until released), and the counters account
	// for the driver's own MIG devices, so the slices do not change
	// (TestManagedMigChangesPublishNothing).
	return out, nil
}

// UnprepareResourceClaims undoes prepares; unknown claims succeed. Like a
// prepare, destroying the driver's MIG devices changes nothing published,
// except under a MIG policy narrower than all: a MIG device of a profile
// the policy does not publish was published only while its claim was
// prepared (the policy was narrowed meanwhile), and is withdrawn now.
func (d *Driver) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	out := make(map[types.UID]error, len(claims))
	destroyedMig := false
	for _, c := range claims {
		start := d.metrics.begin(opUnprepare)
		destroyed, err := d.state.Unprepare(ctx, string(c.UID))
		d.metrics.observe(opUnprepare, start, err)
		out[c.UID] = err
		destroyedMig = destroyedMig || (destroyed && err == nil)
	}
	d.republishAfterMigDestroy(ctx, destroyedMig)
	return out, nil
}

// retryInterrupted retries the rollbacks of interrupted prepares; one that
// destroys a MIG device the driver made changes what is published as an
// unprepare does.
func (d *Driver) retryInterrupted(ctx context.Context) {
	d.republishAfterMigDestroy(ctx, d.state.RetryInterrupted(ctx))
}

// republishAfterMigDestroy republishes after the driver destroyed MIG
// devices it made where that changes the slices: under a MIG policy
// narrower than all (or offering only existing MIG devices) such a device
// was published only while a claim's record named it.
func (d *Driver) republishAfterMigDestroy(ctx context.Context, destroyedMig bool) {
	if destroyedMig && (d.existingMigOnly || !d.migPolicy.PublishesAll()) {
		d.republish(ctx)
	}
}

// HandleError logs background errors; a fatal one stops the plugin through
// its main context rather than exiting deep inside.
func (d *Driver) HandleError(ctx context.Context, err error, msg string) {
	runtime.HandleErrorWithContext(ctx, err, msg)
	if !errors.Is(err, kubeletplugin.ErrRecoverable) && d.cancel != nil {
		d.cancel(fmt.Errorf("fatal background error: %s: %w", msg, err))
	}
}

// Resources builds what the node publishes now, and returns the inventory
// it was built from.
func (d *Driver) Resources(ctx context.Context) (resourceslice.DriverResources, *nvdevice.Inventory, error) {
	inv, err := d.backend.Inventory(ctx)
	if err != nil {
		// While the driver is gone the devices it had stay published,
		// tainted (taints), and prepared claims stay prepared.
		if inv = d.lastInventoryWithoutDriver(err); inv == nil {
			return resourceslice.DriverResources{}, nil, fmt.Errorf("read GPUs: %w", err)
		}
	}
	taints := d.taints(inv)
	managed, err := d.state.ManagedMigDevices(ctx)
	if err != nil {
		return resourceslice.DriverResources{}, nil, err
	}
	res, err := slicebuilder.Build(inv, d.pool, slicebuilder.Options{ManagedMigDevices: managed, Taints: taints, FractionalGPUs: d.fractional, DCGMExporterAttributes: d.dcgmExporterAttributes, ExistingMigOnly: d.existingMigOnly, Mig: d.migPolicy})
	if err != nil {
		return resourceslice.DriverResources{}, nil, err
	}
	d.reportUnpublished(ctx, unpublishedMigGPUs(inv, res))
	d.mu.Lock()
	d.built, d.builtFrom = &res, inv
	d.mu.Unlock()
	if d.metrics != nil {
		n := 0
		for _, p := range res.Pools {
			for _, s := range p.Slices {
				n += len(s.Devices)
			}
		}
		d.metrics.devicesPublished.Set(float64(n))
		d.mu.Lock()
		d.metrics.unhealthyGPUs.Set(float64(len(d.health)))
		d.mu.Unlock()
	}
	return res, inv, nil
}
